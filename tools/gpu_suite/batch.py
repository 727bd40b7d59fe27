"""Batching and pipeline stages on CUDA, then tokens/s against batch size (was tools/gpu_batch_check.py).

(1) continuous batching: staggered arrivals give every request its solo tokens, no graph
fallback; (2) a batch of 3 runs in the bucket of 4 (placeholder row), twice, equal to solo,
no graph fallback; (3) two pipeline stages on one GPU equal one stage; (4) tokens/s of the
medium model (fp16, fp32) for batch 1..16, greedy and k = 1..4, with the verify/decode
step-time ratio per batch size. Tables last; exits 1 if any check fails.
"""

from __future__ import annotations

from pathlib import Path

import ortspec
from ortspec.bench import format_table, run_bench
from ortspec.speculative.batcher import run_arrivals

from .common import (SHORT_PROMPTS, STAGGERED_REQUESTS, TINY, Checks, convert, graph_faults, markdown_table,
                     random_checkpoint, write_json)

SUMMARY = "continuous batching, batch buckets, two stages on one GPU; tokens/s against batch size"


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="/tmp/ortspec_gpu_batch", help="working directory (converted models)")
    parser.add_argument("--checks-only", action="store_true", help="(1)-(3) only, no tokens/s tables")


def run(args) -> int:
    checks, out = Checks(), Path(args.out)
    tiny = convert(TINY, out / "tiny", pipeline_stages=2)
    staggered_arrivals(tiny, checks)
    bucket_of_four(tiny, checks)
    two_stages_on_one_gpu(tiny, checks)
    tables = [] if args.checks_only else medium_benches(out / "medium", checks)
    write_json(args.json, checks.results)
    print("\n\n".join(tables))
    return checks.exit_status()


def staggered_arrivals(model: Path, checks: Checks) -> None:
    solo = [ortspec.Session(model, provider="cuda").generate(p, max_new_tokens=n) for p, n in STAGGERED_REQUESTS]
    for commit, k, wait in (("select", 3, True), ("readvance", 3, True), ("select", 3, False), ("select", 0, False)):
        session = ortspec.Session(model, provider="cuda", num_speculative_tokens=k, commit=commit)
        tokens = run_arrivals(session.batcher(max_batch_size=3), STAGGERED_REQUESTS, wait=wait)
        apart = "" if wait else ", prefills on their thread"
        ok = checks.record(f"batcher_{commit}_k{k}{'' if wait else '_apart'}", tokens == solo)
        print(f"CUDA continuous batching, 6 staggered requests in 3 rows, k={k} {commit}{apart}: equal to solo: {ok}")
        print(f"  graph slots: {session.stats['graphs']}")
        checks.fail(graph_faults(session) != 0)


def bucket_of_four(model: Path, checks: Checks) -> None:
    session = ortspec.Session(model, provider="cuda", num_speculative_tokens=2)
    three = [session.generate(SHORT_PROMPTS, max_new_tokens=24) for _ in range(2)]
    solo = [ortspec.Session(model, provider="cuda").generate(p, max_new_tokens=24) for p in SHORT_PROMPTS]
    ok = all(t == solo for t in three)
    checks.fail(not ok)
    print(f"CUDA batch of 3 in the bucket of 4, twice: equal to solo: {ok}; graphs: {session.stats['graphs']}")
    checks.fail(graph_faults(session) != 0)


def two_stages_on_one_gpu(model: Path, checks: Checks) -> None:
    one = ortspec.Session(model, provider="cuda").generate(SHORT_PROMPTS, max_new_tokens=24)
    for k in (0, 2):
        staged = ortspec.Session(model, provider="cuda", pipeline_stages=2, devices=[0, 0],
                                 num_speculative_tokens=k).generate(SHORT_PROMPTS, max_new_tokens=24)
        ok = staged == one
        checks.fail(not ok)
        print(f"CUDA 2 pipeline stages on one GPU, k={k}: equal to one stage: {ok}")


def medium_benches(medium: Path, checks: Checks) -> list[str]:
    random_checkpoint(medium / "ck", "medium")
    tables = []
    for dtype in ("float16", "float32"):
        model = convert(medium / "ck", medium / dtype, dtype=dtype)
        result = run_bench(model, ks=(0, 1, 2, 3, 4), batches=(1, 2, 4, 8, 16), max_new_tokens=64, repeats=3,
                           provider="cuda", progress=False)
        checks.results[f"bench_medium_{dtype}"] = result
        tables.append(f"### medium (116M params, random), {dtype}, H200\n{format_table(result)}\n\n"
                      f"Verify/decode step time:\n{ratio_table(result)}")
    return tables


def ratio_table(result: dict) -> str:
    """Verify (M=k+1) over decode (M=1) time per step, per batch size, for k = 1..4."""
    rows = {(r["k"], r["batch"]): r for r in result["rows"]}
    decode = {b: r["phase_ms"]["decode"] / r["decode_steps"] for (k, b), r in rows.items() if k == 0}
    lines = []
    for b in sorted(decode):
        cells = []
        for k in (1, 2, 3, 4):
            r = rows[(k, b)]
            verify = r["phase_ms"]["verify"] / r["speculative_steps"]
            cells.append(f"{verify:.2f} ({verify / decode[b]:.2f})")
        lines.append([b, f"{decode[b]:.2f}", *cells])
    header = ["batch", "decode ms/step"] + [f"verify k={k} ms/step (ratio)" for k in (1, 2, 3, 4)]
    return markdown_table(header, lines)
