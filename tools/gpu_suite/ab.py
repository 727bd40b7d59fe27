"""A/B of two ortspec Python packages on one native build and one model (was tools/gpu_ab.sh).

The two sides run `python3 -m ortspec bench` in alternating rounds (old, new, old, new), so
machine noise hits both alike. The old side is a package exported beside the tree:

    git archive OLD_COMMIT ortspec | tar -x -C .ab_old        (here; .ab_old is carried)
    python3 tools/gpu.py ab MODEL_DIR                           (there)

The tree's native extension is copied into the old package (one native build for both). Prints tokens/s
per (k, batch) for both sides with new/old ratios and "MTP/bound" (tokens/s over tokens/step x
greedy tokens/s of the same side); --json gets the means per side.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import ROOT, STAGED_ORT, markdown_table, write_json

SUMMARY = "A/B of an older ortspec package (.ab_old) against the tree on one model, alternating rounds"
# --k, not -k: the old side may predate the -k spelling.
DEFAULT_BENCH_ARGS = "--provider cuda --k 0,1,2,3,4 --batch 1,4,16 --max-new-tokens 128 --repeats 2"


def add_arguments(parser) -> None:
    parser.add_argument("model", help="converted model directory")
    parser.add_argument("--old", default=str(ROOT / ".ab_old"), help="directory holding the old ortspec package")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (each runs old, then new)")
    parser.add_argument("--bench-args", default=os.environ.get("AB_ARGS", DEFAULT_BENCH_ARGS),
                        help="ortspec bench options for both sides (env AB_ARGS sets the default)")


def run(args) -> int:
    old, model = Path(args.old).resolve(), str(Path(args.model).resolve())
    ensure_native(old / "ortspec")
    sides = {"old": old, "new": ROOT}
    runs = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="ortspec-ab-") as workdir:
        for round_ in range(1, args.rounds + 1):
            for side, path in sides.items():
                result = Path(workdir) / f"ab_{side}_{round_}.json"
                bench_side(side, path, model, args.bench_args.split(), result)
                runs[side].append(json.loads(result.read_text()))
    means = {side: mean_rows(results) for side, results in runs.items()}
    print(ab_table(means["old"], means["new"]))
    write_json(args.json, {side: {str(key): value for key, value in m.items()} for side, m in means.items()})
    return 0


def ensure_native(package: Path) -> None:
    """Both sides run the tree's native build: copy it into the old package."""
    if not package.is_dir():
        raise SystemExit(f"{package} is not an ortspec package; export one: git archive OLD_COMMIT ortspec | "
                         f"tar -x -C {package.parent}")
    for built in (ROOT / "ortspec").glob("_native*.so"):
        shutil.copy2(built, package)


def bench_side(side: str, package_root: Path, model: str, bench_args: list[str], json_path: Path) -> None:
    """`python3 -m ortspec bench` with package_root first on the path, run from the temp dir so
    the tree's own package does not come first."""
    paths = [str(package_root), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    if STAGED_ORT.is_dir() and str(STAGED_ORT) not in paths:
        paths.insert(1, str(STAGED_ORT))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1")
    which = [sys.executable, "-c", "import ortspec; print(ortspec.__file__)"]
    print(f"{side}:", subprocess.run(which, env=env, cwd=tempfile.gettempdir(), text=True,
                                                  capture_output=True).stdout.strip(), flush=True)
    command = [sys.executable, "-m", "ortspec", "bench", model, *bench_args, "--json", str(json_path)]
    done = subprocess.run(command, env=env, cwd=tempfile.gettempdir(), text=True, capture_output=True)
    if done.returncode != 0:
        raise SystemExit(f"bench failed for {package_root}:\n{done.stderr[-3000:]}")


def mean_rows(results: list[dict]) -> dict[tuple[int, int], tuple[float, float]]:
    """{(k, batch): (mean tokens/s, mean tokens/step)} over the rounds of one side."""
    table: dict = {}
    for result in results:
        for row in result["rows"]:
            table.setdefault((row["k"], row["batch"]), []).append(row)
    return {key: (statistics.mean(r["tokens_per_second"] for r in rows),
                  statistics.mean(r["mean_tokens_per_step"] for r in rows)) for key, rows in table.items()}


def ab_table(old: dict, new: dict) -> str:
    """Markdown: old and new tokens/s per (k, batch), new/old, and each side's MTP/bound."""

    def bound(side: dict, k: int, batch: int) -> str:
        tokens_per_second, tokens_per_step = side[(k, batch)]
        return "-" if k == 0 else f"{tokens_per_second / (tokens_per_step * side[(0, batch)][0]):.2f}"

    rows = [[k, b, f"{old[(k, b)][0]:.0f}", f"{new[(k, b)][0]:.0f}", f"{new[(k, b)][0] / old[(k, b)][0]:.2f}",
             bound(old, k, b), bound(new, k, b)] for k, b in sorted(old)]
    return markdown_table(["k", "batch", "old tokens/s", "new tokens/s", "new/old", "old MTP/bound", "new MTP/bound"],
                          rows)
