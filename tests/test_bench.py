"""ortspec bench: the side-by-side table, JSON, the transformers row and the plot (timings not asserted)."""

from __future__ import annotations

import json

import pytest

from ortspec import bench_plot
from ortspec.cli import main


def test_bench_cli_writes_table_and_json(models, tmp_path, capsys):
    out = models.converted("base")
    code = main(["bench", str(out), "--k", "0,2", "--batch", "1,2", "--max-new-tokens", "6", "--repeats", "1",
                 "--threads", "1", "--json", str(tmp_path / "b.json"), "--transformers", str(models.checkpoint("base"))])
    assert code == 0
    table = capsys.readouterr().out
    assert "| transformers generate | 1 |" in table and "| 2 | 2 |" in table
    result = json.loads((tmp_path / "b.json").read_text())
    rows = {(r["k"], r["batch"]): r for r in result["rows"]}
    assert set(rows) == {(0, 1), (0, 2), (2, 1), (2, 2)}
    assert rows[(0, 1)]["speedup_vs_greedy"] == 1.0 and rows[(2, 2)]["mean_tokens_per_step"] >= 1.0
    assert rows[(2, 1)]["steps"] > 0 and rows[(2, 1)]["phase_ms"]["verify"] > 0
    assert rows[(2, 1)]["steps"] == rows[(2, 1)]["speculative_steps"] and rows[(0, 1)]["speculative_steps"] == 0
    assert rows[(0, 1)]["pipelined_steps"] == 0  # on the CPU the plain loop runs (CUDA: greedy and auto's k = 0)
    assert len(rows[(2, 2)]["repeat_seconds"]) == 1  # one per repeat: the plot's error bars
    assert rows[(0, 2)]["cpu_speedup_vs_greedy"] == 1.0 and rows[(2, 2)]["cpu_seconds"] > 0


@pytest.mark.parametrize("p,accepted", [(1.0, 1.0), (0.0, 0.0)])
def test_bench_scripted_drafts_set_the_acceptance(models, tmp_path, p, accepted):
    """--scripted-drafts P: drafts right with probability P whatever the head proposes (1: every
    draft accepted, 0: none); greedy rows unchanged."""
    code = main(["bench", str(models.converted("base")), "-k", "0,3", "--batch", "1,2", "--max-new-tokens", "9",
                 "--repeats", "1", "--threads", "1", "--scripted-drafts", str(p), "--json", str(tmp_path / "b.json")])
    assert code == 0
    result = json.loads((tmp_path / "b.json").read_text())
    rows = {(r["k"], r["batch"]): r for r in result["rows"]}
    assert result["scripted_drafts"] == p and rows[(0, 2)]["acceptance_rate"] == 0.0
    assert rows[(3, 1)]["acceptance_rate"] == rows[(3, 2)]["acceptance_rate"] == accepted


def test_bench_refuses_a_probability_outside_0_1(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "x", "--scripted-drafts", "1.5"])
    assert "expected a probability between 0 and 1" in capsys.readouterr().err


def test_bench_converts_a_checkpoint_per_dtype(models, tmp_path, capsys):
    """`ortspec bench CHECKPOINT --dtype float32,float16`: both converted and benched side by side,
    each row labelled with its dtype and compared with greedy of its own dtype."""
    code = main(["bench", str(models.checkpoint("base")), "--dtype", "float32,float16", "--k", "0,1", "--batch", "1",
                 "--max-new-tokens", "4", "--repeats", "1", "--threads", "1", "--json", str(tmp_path / "b.json")])
    assert code == 0
    table = capsys.readouterr().out
    assert "| dtype | k | batch |" in table and "| float16 | 1 | 1 |" in table
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["dtypes"] == ["float32", "float16"]
    greedy = {r["dtype"]: r for r in result["rows"] if r["k"] == 0}
    assert greedy["float32"]["speedup_vs_greedy"] == greedy["float16"]["speedup_vs_greedy"] == 1.0


def test_bench_dtype_of_a_converted_model_must_match(models, capsys):
    code = main(["bench", str(models.converted("base")), "--dtype", "float16", "--k", "0"])
    assert code == 2
    assert "was converted with dtype float32; --dtype float16 needs the checkpoint" in capsys.readouterr().err


BENCH = {"model": "/x/out/qwen35-python-20m", "provider": "cuda", "threads": None, "max_new_tokens": 128,
         "repeats": 3, "dtypes": ["float16"],
         "rows": [{"k": k, "batch": 1, "dtype": "float16", "tokens_per_second": 128 / s, "seconds": s,
                   "repeat_seconds": [s, s * 1.1, s * 0.95]} for k, s in ((0, 0.2), (2, 0.1))]}


def test_plot_series_have_error_bars_from_the_repeats_and_a_full_title():
    [line] = bench_plot.series(BENCH)
    assert line["k"] == [0, 2] and line["tokens_per_second"] == pytest.approx([640, 1280])
    assert line["below"] == pytest.approx([640 - 128 / 0.22, 1280 - 128 / 0.11])  # down to the slowest repeat
    assert line["above"] == pytest.approx([128 / 0.19 - 640, 128 / 0.095 - 1280])  # up to the fastest
    title = bench_plot.title(BENCH)
    for part in ("qwen35-python-20m", "float16", "cuda", "threads", "128 new tokens", "median of 3"):
        assert part in title


def test_plot_y_axis_starts_at_zero(tmp_path):
    pytest.importorskip("matplotlib")
    figure = bench_plot.draw(BENCH)
    [axes] = figure.axes
    assert axes.get_ylim()[0] == 0 and axes.get_title() == bench_plot.title(BENCH)
    bench_plot.write_plot(BENCH, tmp_path / "b.png")
    assert [p.name for p in tmp_path.iterdir()] == ["b.png"]


def test_bench_reads_held_out_prompts(models, tmp_path, capsys):
    """--prompts FILE: the texts of a JSON list instead of the bench's own; a bad file is refused."""
    (tmp_path / "p.json").write_text(json.dumps(["def f(x):\n    return", "class A:"]))
    code = main(["bench", str(models.converted("base")), "--k", "0,1", "--max-new-tokens", "4", "--repeats", "1",
                 "--prompts", str(tmp_path / "p.json"), "--json", str(tmp_path / "b.json")])
    assert code == 0
    assert json.loads((tmp_path / "b.json").read_text())["prompts"] == ["def f(x):\n    return", "class A:"]
    (tmp_path / "bad.json").write_text("{}")
    assert main(["bench", str(models.converted("base")), "--k", "0", "--prompts", str(tmp_path / "bad.json")]) == 2
    assert "must hold a non-empty JSON list" in capsys.readouterr().err
