"""Train the small model, convert it, check it and benchmark it (was tools/gpu_trained.sh).

Trains tools/train_tiny.py on CUDA into --trained-dir (a finished run there, train_log.json
present, is used as is), converts it to fp32 and fp16 (max length 1024), checks speculative
== greedy on CUDA (k = 1..4, both commits, 4 code prompts x 96 tokens; reported, not
counted), prints a sample, benches fp16 beside transformers' generate into
RESULTS/bench_trained_fp16.json (and .png where matplotlib is installed), and packs the
checkpoint as RESULTS/trained.tgz.partNN (15 MB parts).

    MINUTES=7 TRAIN_ARGS="--site-packages --max-corpus-mb 200" python3 tools/gpu.py trained
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import ortspec
from ortspec.bench import format_table, write_outputs

from .common import (CODE_PROMPTS, HOST_OUT, ROOT, bench_code_model, convert, identity_lines,
                     speculative_matches_greedy, write_json)

SUMMARY = "train the small model on CUDA, convert fp32/fp16, identity, bench beside transformers, pack it"
PART_BYTES = 15 * 2**20


def add_arguments(parser) -> None:
    parser.add_argument("--trained-dir", default="/tmp/trained", help="training output (reused when finished)")
    parser.add_argument("--minutes", default=os.environ.get("MINUTES", "7"), help="training time (env MINUTES)")
    parser.add_argument("--train-args", default=os.environ.get("TRAIN_ARGS", ""),
                        help="more train_tiny.py options (env TRAIN_ARGS)")
    parser.add_argument("--results", default=str(HOST_OUT), help="where bench, eval and packed parts go "
                                                                 "(default: $OUT)")


def run(args) -> int:
    trained, results = Path(args.trained_dir), Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    if not train(trained, args.minutes, args.train_args.split()):
        return 1
    models = [convert(trained, trained.parent / f"{trained.name}_{tag}", dtype=dtype, max_length=1024)
              for tag, dtype in (("fp32", "float32"), ("fp16", "float16"))]
    identity = {}
    for model in models:
        same = speculative_matches_greedy(model, CODE_PROMPTS, 96)
        print(identity_lines(str(model), same))
        identity.update({f"{model.name}_{commit}_k{k}_equals_greedy": ok for (commit, k), ok in same.items()})
    sample = ortspec.Session(models[1], provider="cuda", num_speculative_tokens=3).generate(CODE_PROMPTS[0],
                                                                                           max_new_tokens=80)
    print("sample (fp16, k=3):", repr(sample))
    bench_fp16(models[1], trained, results)
    write_json(args.json, identity)
    if (trained / "eval.json").exists():
        shutil.copy2(trained / "eval.json", results)
    pack(trained, results)
    for path in sorted(results.iterdir()):
        print(f"{path.stat().st_size:>12} {path.name}")
    return 0


def train(trained: Path, minutes: str, train_args: list[str]) -> bool:
    """Runs train_tiny.py unless a finished run is there; prints the last 45 lines of its log."""
    if (trained / "train_log.json").exists():
        log = Path("/tmp/train.log")  # where a training started in the background writes
        print("\n".join(log.read_text().splitlines()[-45:]) if log.exists() else f"{trained}: trained already")
        return True
    command = [sys.executable, str(ROOT / "tools" / "train_tiny.py"), str(trained), "--minutes", minutes,
               "--device", "cuda", *train_args]
    done = subprocess.run(command, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    print("\n".join(done.stdout.splitlines()[-45:]))
    return done.returncode == 0


def bench_fp16(model: Path, checkpoint: Path, results: Path) -> None:
    """bench_trained_fp16.json, and the plot where matplotlib is installed (the host may lack it)."""
    from ortspec.bench_plot import require_matplotlib
    from ortspec.errors import MissingDependencyError

    bench = bench_code_model(model, transformers_checkpoint=checkpoint)
    print(format_table(bench))
    try:
        require_matplotlib()
        plot = results / "bench_trained_fp16.png"
    except MissingDependencyError as error:
        print(f"no plot: {error}")
        plot = None
    write_outputs(bench, results / "bench_trained_fp16.json", plot)


def pack(trained: Path, results: Path) -> None:
    """trained.tgz of the checkpoint directory, split into 15 MB parts RESULTS/trained.tgz.part00, 01, ..."""
    archive = trained.parent / f"{trained.name}.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(trained, arcname=trained.name)
    with archive.open("rb") as source:
        for index, chunk in enumerate(iter(lambda: source.read(PART_BYTES), b"")):
            (results / f"trained.tgz.part{index:02d}").write_bytes(chunk)
