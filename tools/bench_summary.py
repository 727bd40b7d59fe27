"""Several ``ortspec bench --json`` runs of one configuration as one table: per batch and k the
median speed-up over greedy with its min-max over the runs (each run's own greedy), the median
greedy tokens/s, and which k auto ran.

    python tools/bench_summary.py RUN.json [RUN.json ...]

Runs are grouped by the model, threads and prompt set they record, so one call can take a whole
matrix (``benchmarks/`` and BENCHMARKS.md show the command that made each). The "best" column is
the k >= 1 (or auto) with the highest median speed-up.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
from pathlib import Path


def load(paths: list[str]) -> dict[tuple, list[dict]]:
    """(model, threads, prompts) -> the runs of that configuration, read from the files."""
    return group([json.loads(Path(path).read_text()) for path in paths])


def group(runs: list[dict]) -> dict[tuple, list[dict]]:
    """(model, threads, prompts) -> the runs of that configuration."""
    groups: dict[tuple, list[dict]] = collections.defaultdict(list)
    for run in runs:
        prompts = "bench" if run.get("prompts") in (None, "bench") else "held-out"  # else the texts given
        groups[(Path(run["model"]).name, run.get("threads"), prompts)].append(run)
    return groups


def cells(runs: list[dict]) -> dict[tuple[int, str], dict]:
    """(batch, k) -> speed-ups over the runs, greedy tokens/s, steps by k (auto)."""
    out: dict[tuple[int, str], dict] = collections.defaultdict(lambda: {"speedups": [], "tps": [], "steps": []})
    for run in runs:
        for row in run["rows"]:
            cell = out[(row["batch"], str(row["k"]))]
            cell["speedups"].append(row["speedup_vs_greedy"])
            cell["tps"].append(row["tokens_per_second"])
            cell["steps"].append(row.get("steps_by_k", []))
    return out


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}]"


def table(groups: dict[tuple, list[dict]]) -> list[str]:
    ks = sorted({str(row["k"]) for runs in groups.values() for run in runs for row in run["rows"]} - {"0"},
                key=lambda k: (k == "auto", k))
    lines = ["| model | threads | prompts | batch | runs | greedy tok/s | " + " | ".join(k if k == "auto" else f"k={k}" for k in ks)
             + " | best | auto's steps by k (last run) |",
             "|---" * (7 + len(ks)) + "|---|"]
    for (model, threads, prompts), runs in sorted(groups.items(), key=lambda item: tuple(map(str, item[0]))):
        by_cell = cells(runs)
        for batch in sorted({b for b, _ in by_cell}):
            medians = {k: statistics.median(by_cell[(batch, k)]["speedups"]) for k in ks if (batch, k) in by_cell}
            best = max(medians, key=medians.get)
            greedy = statistics.median(by_cell[(batch, "0")]["tps"])
            auto = by_cell.get((batch, "auto"), {}).get("steps", [[]])[-1]
            lines.append(f"| {model} | {threads} | {prompts} | {batch} | {len(runs)} | {greedy:.0f} | "
                         + " | ".join(spread(by_cell[(batch, k)]["speedups"]) if (batch, k) in by_cell else "-"
                                      for k in ks)
                         + f" | **{medians[best]:.2f}x** ({'k=' + best if best != 'auto' else 'auto'}) | {auto} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="ortspec bench --json files")
    args = parser.parse_args(argv)
    print("\n".join(table(load(args.runs))))


if __name__ == "__main__":
    main()
