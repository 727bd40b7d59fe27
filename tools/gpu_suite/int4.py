"""int4 (MatMulNBits) identity and tokens/s on the shipped trained model (was tools/gpu_int4.sh).

Converts models/qwen35-python-20m with --quant int4 --dtype float16, checks speculative ==
greedy on CUDA (k = 1..4, both commits, 4 code prompts x 96 tokens; reported, not counted:
the script only measures), then benches k = 0..4 at batch 1/4/16 x 128 tokens into
RESULTS/bench_int4.json.
"""

from __future__ import annotations

from pathlib import Path

from ortspec.bench import format_table

from .common import (CODE_PROMPTS, HOST_OUT, TRAINED, bench_code_model, convert, identity_lines,
                     speculative_matches_greedy, write_json)

SUMMARY = "int4 (MatMulNBits) conversion of the trained model: identity and tokens/s"


def add_arguments(parser) -> None:
    parser.add_argument("--work", default="/tmp", help="where the converted model goes (WORK/q4)")
    parser.add_argument("--results", default=str(HOST_OUT), help="where bench_int4.json goes (default: $OUT)")


def run(args) -> int:
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    model = convert(TRAINED, Path(args.work) / "q4", dtype="float16", max_length=1024, quant="int4")
    same = speculative_matches_greedy(model, CODE_PROMPTS, 96)
    print(identity_lines("int4", same))
    bench = bench_code_model(model)
    write_json(results / "bench_int4.json", bench)
    print(format_table(bench))
    write_json(args.json, {f"int4_{commit}_k{k}_equals_greedy": ok for (commit, k), ok in same.items()})
    return 0
