"""ortspec bench: the side-by-side table, JSON and the transformers row (timings not asserted)."""

from __future__ import annotations

import json

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
