"""GPU host check for batching and pipeline stages, then tokens/s against batch size.

    python tools/gpu_batch_check.py [--out DIR]

(1) continuous batching on CUDA: staggered arrivals give every request its solo tokens;
(2) a batch of 3 runs in the bucket of 4 (placeholder row) with graph fallbacks 0;
(3) two pipeline stages on one GPU equal one stage; (4) tokens/s for batch 1..16, greedy and
k = 1..4, with the verify/decode step-time ratio per batch size. Prints tables last.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import onnxruntime as ort  # noqa: E402

import ortspec  # noqa: E402
from ortspec.bench import format_table, run_bench  # noqa: E402
from ortspec.speculative.batcher import run_arrivals  # noqa: E402
from tools.gpu_check import MEDIUM  # noqa: E402
from tools.make_tiny_checkpoint import make_checkpoint  # noqa: E402

REQUESTS = [([5, 17, 99, 3, 250, 7, 11], 30), ([42], 45), ([8, 8, 8, 300, 1, 2, 3, 4, 5, 6, 7, 8, 9], 12),
            ([1, 2], 25), ([400, 3, 3, 3], 40), ([77] * 20, 18)]


def staggered(session, max_batch_size=3):
    return run_arrivals(session.batcher(max_batch_size=max_batch_size), REQUESTS)


def ratio_table(result) -> str:
    """Verify (M=k+1) over decode (M=1) time per step, per batch size."""
    decode = {r["batch"]: r["phase_ms"]["decode"] / r["steps"] for r in result["rows"] if r["k"] == 0}
    lines = ["| batch | decode ms/step | " + " | ".join(f"verify k={k} ms/step (ratio)" for k in (1, 2, 3, 4)) + " |",
             "|---|---|---|---|---|---|"]
    for b in sorted(decode):
        cells = []
        for k in (1, 2, 3, 4):
            r = next(r for r in result["rows"] if r["k"] == k and r["batch"] == b)
            v = r["phase_ms"]["verify"] / r["steps"]
            cells.append(f"{v:.2f} ({v / decode[b]:.2f})")
        lines.append(f"| {b} | {decode[b]:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/ortspec_gpu_batch")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    ort.set_default_logger_severity(3)
    out, failures, results = Path(args.out), 0, {}
    ortspec.convert(ROOT / "models" / "tiny-qwen35", out / "tiny", num_speculative_tokens=4, max_length=512,
                    pipeline_stages=2, overwrite=True, progress=False)
    solo = [ortspec.Session(out / "tiny", provider="cuda").generate(p, max_new_tokens=n) for p, n in REQUESTS]
    for commit in ("select", "readvance"):
        session = ortspec.Session(out / "tiny", provider="cuda", num_speculative_tokens=3, commit=commit)
        ok = staggered(session) == solo
        failures += not ok
        results[f"batcher_{commit}"] = ok
        print(f"CUDA continuous batching, 6 staggered requests in 3 rows, k=3 {commit}: equal to solo: {ok}")
        fallbacks = sum(c["fallbacks"] + c["invalidations"] for c in session.stats["graphs"].values())
        print(f"  graph slots: {session.stats['graphs']}")
        failures += fallbacks != 0

    prompts = [p for p, _ in REQUESTS[:3]]
    session = ortspec.Session(out / "tiny", provider="cuda", num_speculative_tokens=2)
    three = [session.generate(prompts, max_new_tokens=24) for _ in range(2)]
    ok = all(t == [ortspec.Session(out / "tiny", provider="cuda").generate(p, max_new_tokens=24) for p in prompts]
             for t in three)
    failures += not ok
    print(f"CUDA batch of 3 in the bucket of 4, twice: equal to solo: {ok}; graphs: {session.stats['graphs']}")
    failures += any(c["fallbacks"] or c["invalidations"] for c in session.stats["graphs"].values())

    one = ortspec.Session(out / "tiny", provider="cuda").generate(prompts, max_new_tokens=24)
    for k in (0, 2):
        staged = ortspec.Session(out / "tiny", provider="cuda", pipeline_stages=2, devices=[0, 0],
                                 num_speculative_tokens=k).generate(prompts, max_new_tokens=24)
        ok = staged == one
        failures += not ok
        print(f"CUDA 2 pipeline stages on one GPU, k={k}: equal to one stage: {ok}")

    medium = out / "medium"
    make_checkpoint(medium / "ck", seed=7, draft_agreement=10.0, **MEDIUM)
    tables = []
    for dtype in ("float16", "float32"):
        ortspec.convert(medium / "ck", medium / dtype, num_speculative_tokens=4, max_length=512, dtype=dtype,
                        overwrite=True, progress=False)
        result = run_bench(medium / dtype, ks=(0, 1, 2, 3, 4), batches=(1, 2, 4, 8, 16), max_new_tokens=64,
                           repeats=3, provider="cuda", progress=False)
        results[f"bench_medium_{dtype}"] = result
        tables.append(f"### medium (116M params, random), {dtype}, H200\n{format_table(result)}\n\n"
                      f"Verify/decode step time:\n{ratio_table(result)}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print("\n\n".join(tables))
    print("failures:", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
