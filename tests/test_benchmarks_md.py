"""tools/benchmarks_md.py: BENCHMARKS.md and docs/benchmarks-history.md are what their templates and
the JSON runs make, and the renderers put each run's own numbers in the cells."""

import json

import pytest

from tools import benchmarks_md


def bench_run(rows):
    return {"model": "/tmp/m", "threads": 1, "prompts": "bench", "rows": rows}


def bench_row(k, batch, tps, speedup, steps_by_k=()):
    return {"k": k, "batch": batch, "tokens_per_second": tps, "speedup_vs_greedy": speedup,
            "steps_by_k": list(steps_by_k)}


def test_benchmarks_md_is_what_the_template_makes():
    assert [output.name for _, output in benchmarks_md.PAGES] == ["BENCHMARKS.md", "benchmarks-history.md"]
    assert benchmarks_md.main(["--check"]) == 0, \
        "run python3 tools/benchmarks_md.py and commit BENCHMARKS.md and docs/benchmarks-history.md"


def test_check_fails_when_either_page_differs(tmp_path, monkeypatch):
    pages = []
    for name in ("a", "b"):
        (tmp_path / f"{name}.in.md").write_text(f"# {name}\n")
        pages.append((tmp_path / f"{name}.in.md", tmp_path / f"{name}.md"))
    monkeypatch.setattr(benchmarks_md, "ROOT", tmp_path)
    monkeypatch.setattr(benchmarks_md, "PAGES", pages)
    assert benchmarks_md.main([]) == 0 and benchmarks_md.main(["--check"]) == 0
    assert "from a.in.md" in (tmp_path / "a.md").read_text()  # the header names its template
    (tmp_path / "b.md").write_text("edited by hand\n")
    assert benchmarks_md.main(["--check"]) == 1


def test_bench_puts_runs_side_by_side(tmp_path):
    runs = [bench_run([bench_row(0, 1, 2000.4, 1.0, [10]), bench_row(2, 1, 2400, 1.2), bench_row("auto", 1, 2300, 1.15,
                                                                                                  [1, 0, 0, 9])]),
            bench_run([bench_row(0, 1, 1990, 1.0, [10]), bench_row(2, 1, 2380, 1.196),
                       bench_row("auto", 1, 2290, 1.151, [0, 0, 8, 2])])]
    for i, run in enumerate(runs):
        (tmp_path / f"r{i}.json").write_text(json.dumps(run))
    text = benchmarks_md.render("# t\n<!-- table: bench r*.json -->\nafter", root=tmp_path)
    lines = text.splitlines()
    assert "| 0 (greedy) | 2000 / 1990 tok/s |" in lines
    assert "| k=2 | 1.20x / 1.20x |" in lines
    assert "| auto | 1.15x / 1.15x (k=2) |" in lines  # the k the last run spent most steps at
    assert lines[-1] == "after" and "# t" in lines


def test_peer_gives_ratios_to_the_peer_graph_greedy(tmp_path):
    def config(name, tps, differ=0):
        return {"name": name, "tokens_per_second": tps, "tokens_per_second_min": tps - 10,
                "tokens_per_second_max": tps + 10, "tokens_per_step": 1.0, "differs_from_ortspec_greedy": differ,
                "prompts_compared": 16}

    (tmp_path / "p.json").write_text(json.dumps({"configs": [config("ortspec greedy", 2000),
                                                             config("peer graph", 1600, differ=16)]}))
    text = benchmarks_md.render("<!-- table: peer p.json -->", root=tmp_path)
    assert "| ortspec greedy | 2000 | 1990-2010 | 1.00 | 0/16 | 1.25x |" in text
    assert "| peer graph | 1600 | 1590-1610 | 1.00 | 16/16 | 1.00x |" in text


@pytest.mark.parametrize("directive, message", [("<!-- table: nosuch a.json -->", "unknown renderer"),
                                                ("<!-- table: bench missing.json -->", "no such file")])
def test_a_bad_directive_is_named(tmp_path, directive, message):
    with pytest.raises(benchmarks_md.TemplateError, match=message):
        benchmarks_md.render(directive, root=tmp_path)
