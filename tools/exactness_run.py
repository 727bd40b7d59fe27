"""Long exactness run: speculative decoding vs a plain decode, states compared after every commit.

    python tools/exactness_run.py --steps 10000

Makes (or reuses) a tiny random checkpoint, converts it, and runs scripted-draft speculative
decoding for both commit strategies and k = 1..K over a batch of prompts until the requested
number of speculative row-steps is reached, comparing every state bitwise with the plain
decode after every commit. select runs twice: each step in one Run (the MTP head inside the
verify's graph, verify_mtp_k{k}) and in two ("select/2 runs": fused_verify=False). Prints one line per run and a summary table; exits non-zero on
the first difference.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ortspec  # noqa: E402
from ortspec.runtime.graphs import GraphSet  # noqa: E402
from ortspec.speculative.exactness import check_speculative, plain_decode_states  # noqa: E402
from tools.make_tiny_checkpoint import make_checkpoint  # noqa: E402


VARIANTS = {"select": ("select", True), "select/2 runs": ("select", False), "readvance": ("readvance", True)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10_000, help="speculative row-steps to check in total")
    parser.add_argument("--k-max", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="ortspec_exactness_"))
    make_checkpoint(work / "ck", seed=args.seed)
    ortspec.convert(work / "ck", work / "out", num_speculative_tokens=args.k_max, max_length=512, progress=False)
    graphs = GraphSet(ortspec.Session(work / "out").manifest)
    rng = np.random.default_rng(args.seed)
    vocab = graphs.manifest.spec.vocab_size

    total, round_, rows = 0, 0, []
    start = time.perf_counter()
    while total < args.steps:
        prompts = [rng.integers(0, vocab, rng.integers(1, 40)).tolist() for _ in range(args.batch)]
        for k in range(1, args.k_max + 1):
            reference = plain_decode_states(graphs, prompts, args.new_tokens + k + 1, k)
            for label, (commit, fused) in VARIANTS.items():
                p = None if round_ % 2 == 0 else float(rng.uniform(0.3, 0.95))
                stats = check_speculative(graphs, prompts, args.new_tokens, k, commit, p=p,
                                          seed=int(rng.integers(1 << 30)), reference=reference, fused_verify=fused)
                total += stats.speculative_row_steps
                rows.append((k, label, stats.speculative_row_steps, stats.accept_histogram))
                print(f"k={k} {label:13s} p={'uniform' if p is None else f'{p:.2f}':7s} "
                      f"row-steps {stats.speculative_row_steps:5d} accept lengths {stats.accept_histogram} -> identical",
                      flush=True)
        round_ += 1
    seconds = time.perf_counter() - start
    print(f"\n{total} speculative row-steps, every commit's states bitwise equal to the plain decode "
          f"({seconds:.0f} s, batch {args.batch}, k 1..{args.k_max}, both commits, select in one Run and in two)")
    print("| k | commit | row-steps | accept-length histogram |")
    print("|---|---|---|---|")
    for k in range(1, args.k_max + 1):
        for label in VARIANTS:
            steps = sum(r[2] for r in rows if r[:2] == (k, label))
            hist = np.sum([r[3] for r in rows if r[:2] == (k, label)], axis=0).tolist()
            print(f"| {k} | {label} | {steps} | {hist} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
