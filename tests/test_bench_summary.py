"""tools/bench_summary.py: runs of one configuration become one row per batch, each k's median
speed-up with its min-max, configurations kept apart."""

from __future__ import annotations

import json

from tools import bench_summary


def run(path, model, threads, prompts, speedups, auto_steps):
    rows = [{"k": 0, "batch": 4, "tokens_per_second": 500.0, "speedup_vs_greedy": 1.0, "steps_by_k": [63]}]
    rows += [{"k": k, "batch": 4, "tokens_per_second": 500.0 * s, "speedup_vs_greedy": s, "steps_by_k": []}
             for k, s in speedups.items() if k != "auto"]
    rows.append({"k": "auto", "batch": 4, "tokens_per_second": 1.0, "speedup_vs_greedy": speedups["auto"],
                 "steps_by_k": auto_steps})
    path.write_text(json.dumps({"model": f"out/{model}", "threads": threads, "prompts": prompts, "rows": rows}))
    return str(path)


def test_runs_of_one_configuration_make_one_row(tmp_path, capsys):
    paths = [run(tmp_path / "a.json", "m", 1, "bench", {1: 1.2, 2: 1.5, "auto": 1.4}, [0, 2, 20]),
             run(tmp_path / "b.json", "m", 1, "bench", {1: 1.1, 2: 1.3, "auto": 1.45}, [0, 1, 21]),
             run(tmp_path / "c.json", "m", 1, "bench", {1: 1.3, 2: 1.4, "auto": 1.5}, [0, 0, 22]),
             run(tmp_path / "d.json", "m", 2, ["a prompt"], {1: 0.9, 2: 0.8, "auto": 1.0}, [30])]
    bench_summary.main(paths)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| model | threads | prompts | batch | runs | greedy tok/s | k=1 | k=2 | auto |")
    one, two = lines[2], lines[3]
    assert "| m | 1 | bench | 4 | 3 | 500 | 1.20x [1.10-1.30] | 1.40x [1.30-1.50] | 1.45x [1.40-1.50] |" in one
    assert "**1.45x** (auto) | [0, 0, 22] |" in one  # the best median; the last run's steps
    assert "| m | 2 | held-out | 4 | 1 |" in two and "**1.00x** (auto)" in two
