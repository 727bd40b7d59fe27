"""Pipeline stages on separate GPUs, then tokens/s of one stage against two (was tools/gpu_pipeline.py).

Stages go on devices [0, 1] where the host has two GPUs, else on [0, 0] (the same code, no
peer copy). (1) two stages on those devices give the tokens of one stage, greedy and
speculative (k = 2 select, k = 3 readvance), twice, with no CUDA-graph fallback; (2) every
state after every commit equals a one-stage CUDA plain decode within 1e-5 (scripted drafts,
batch 3, k = 3, both commits); (3) tokens/s of the medium fp16 model, one stage against two
stages on one GPU and (where present) two GPUs, batch 1/4/16, k = 0 and 2. Table last.
"""

from __future__ import annotations

from pathlib import Path

import ortspec
from ortspec.bench import run_bench
from ortspec.runtime.graphs import GraphSet
from ortspec.speculative.exactness import plain_decode_states

from .common import (SHORT_PROMPTS, TINY, Checks, convert, graph_faults, markdown_table, random_checkpoint,
                     state_check_row_steps, write_json)

SUMMARY = "pipeline stages on devices [0, 1] (or [0, 0]): tokens, states, graph counters; tokens/s by layout"


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="/tmp/ortspec_gpu_pipeline", help="working directory (converted models)")


def run(args) -> int:
    from ortspec import _native

    gpus = _native.build_info()["cuda_device_count"]
    devices = [0, 1] if gpus >= 2 else [0, 0]
    print(f"{gpus} GPU(s); two stages on devices {devices}")
    checks, out = Checks(), Path(args.out)
    checks.results.update(gpus=gpus, devices=devices)
    tiny = convert(TINY, out / "tiny", max_length=256, pipeline_stages=2)
    staged_tokens(tiny, devices, checks)
    staged_states(tiny, devices, checks)
    medium = out / "medium"
    random_checkpoint(medium / "ck", "medium")
    convert(medium / "ck", medium / "fp16", dtype="float16", pipeline_stages=2)
    layouts = [("1 stage", 1, None), ("2 stages, 1 GPU", 2, [0, 0])] + ([("2 stages, 2 GPUs", 2, [0, 1])]
                                                                         if gpus >= 2 else [])
    benches = {label: run_bench(medium / "fp16", ks=(0, 2), batches=(1, 4, 16), max_new_tokens=64, repeats=3,
                                provider="cuda", pipeline_stages=stages, devices=devs, progress=False)
               for label, stages, devs in layouts}
    checks.results["bench"] = benches
    write_json(args.json, checks.results)
    print("\n### medium (116M params, random), fp16, tokens/s by pipeline layout\n")
    print(layout_table(benches))
    return checks.exit_status()


def staged_tokens(model: Path, devices: list[int], checks: Checks) -> None:
    one = ortspec.Session(model, provider="cuda").generate(SHORT_PROMPTS, max_new_tokens=48)
    for k, commit in ((0, "select"), (2, "select"), (3, "readvance")):
        session = ortspec.Session(model, provider="cuda", pipeline_stages=2, devices=devices,
                                  num_speculative_tokens=k, commit=commit)
        ok = [session.generate(SHORT_PROMPTS, max_new_tokens=48) for _ in range(2)] == [one, one]
        bad_graphs = graph_faults(session)
        checks.record(f"tokens_k{k}_{commit}", ok)
        checks.fail(bad_graphs != 0)
        print(f"two stages on {devices}, k={k} {commit}, twice: equal to one stage: {ok}; "
              f"graph fallbacks+invalidations: {bad_graphs}")


def staged_states(model: Path, devices: list[int], checks: Checks) -> None:
    single = GraphSet(ortspec.Session(model, provider="cuda").manifest, provider="cuda")
    staged = GraphSet(single.manifest, provider="cuda", devices=devices)
    reference = plain_decode_states(single, SHORT_PROMPTS, 40 + 3 + 1, 3)
    steps = 0
    for commit in ("select", "readvance"):
        row_steps = state_check_row_steps(staged, SHORT_PROMPTS, 40, 3, commit, p=0.6, reference=reference,
                                          atol=1e-5, stages=2)
        steps += row_steps or 0
        checks.fail(row_steps is None)
    checks.results["state_check_steps"] = steps
    print(f"states after every commit, two stages on {devices} vs one-stage plain decode: {steps} steps within 1e-5 x (1 + each state's largest |value|)")
    print("weight bytes per device:", staged.weight_bytes)


def layout_table(benches: dict[str, dict]) -> str:
    """tokens/s per (k, batch) and layout, each with its ratio to the first layout (one stage)."""
    base = next(iter(benches.values()))["rows"]
    rows = [[row["k"], row["batch"]] + [f"{b['rows'][i]['tokens_per_second']:.0f} "
                                        f"({b['rows'][i]['tokens_per_second'] / row['tokens_per_second']:.2f})"
                                        for b in benches.values()]
            for i, row in enumerate(base)]
    return markdown_table(["k", "batch", *benches], rows)
