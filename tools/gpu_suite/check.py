"""CUDA-provider correctness against the CPU and greedy, then tokens/s (was tools/gpu_check.py).

Converts models/tiny-qwen35, then checks (1) CUDA greedy vs CPU greedy tokens, (2) CUDA
speculative (k = 1..4, select and readvance) vs CUDA greedy tokens for fp32, fp16 and bf16,
(3) the scripted-draft state check on CUDA (states after every commit vs a CUDA plain
decode, within 1e-5), (4) device memory of three sessions with and without shared weights,
(5) CUDA-graph counters (a second call of the same batch size only replays), and (6) greedy
vs speculative tokens/s side by side (--no-bench skips it). Tables last; exits 1 if any
identity check fails.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import onnxruntime as ort

import ortspec
from ortspec.bench import format_table, run_bench
from ortspec.runtime import custom_ops
from ortspec.runtime.graphs import GraphSet
from ortspec.speculative.exactness import plain_decode_states

from .common import (IDENTITY_PROMPTS, TINY, Checks, convert, random_checkpoint, speculative_matches_greedy,
                     state_check_row_steps, write_json)

SUMMARY = "CUDA vs CPU and speculative vs greedy identity, state check, memory, graph counters, tokens/s"
DTYPES = ("float32", "float16", "bfloat16")


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="/tmp/ortspec_gpu_check", help="working directory (converted models)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per request in the identity checks")
    parser.add_argument("--no-bench", action="store_true", help="identity, state and graph checks only")


def run(args) -> int:
    from ortspec import _native

    print("onnxruntime", ort.__version__, ort.get_available_providers())
    print("native", json.dumps(_native.build_info()))
    checks, out, n = Checks(), Path(args.out), args.new_tokens
    convert(TINY, out)
    cuda_greedy_equals_cpu(out, n, checks)
    models = {dtype: out if dtype == "float32" else convert(TINY, Path(f"{args.out}_{dtype}"), dtype=dtype)
              for dtype in DTYPES}
    for dtype, model in models.items():
        speculative_identity(dtype, model, n, checks)
    state_check(out, checks)
    medium = Path(args.out + "_medium")
    random_checkpoint(medium / "ck", "medium")
    convert(medium / "ck", medium / "out")
    convert(medium / "ck", medium / "out_fp16", dtype="float16")
    checks.results["memory_mib"] = memory_with_and_without_sharing(medium / "out")
    print("device memory (MiB):", checks.results["memory_mib"])
    graph_counters(out, checks)
    tables = {} if args.no_bench else benches(
        {"tiny-qwen35": out, "medium (116M params, random), fp32": medium / "out",
         "medium (116M params, random), fp16": medium / "out_fp16"}, n, checks)
    write_json(args.json, checks.results)
    for label, table in tables.items():
        print(f"\n### {label}, CUDA\n{table}")
    return checks.exit_status("identity failures")


def cuda_greedy_equals_cpu(model: Path, n: int, checks: Checks) -> None:
    cpu = ortspec.Session(model).generate(IDENTITY_PROMPTS, max_new_tokens=n)
    gpu = ortspec.Session(model, provider="cuda").generate(IDENTITY_PROMPTS, max_new_tokens=n)
    same = [a == b for a, b in zip(cpu, gpu)]
    checks.results["cuda_greedy_equals_cpu_greedy"] = same  # reported, not counted: CPU and CUDA kernels differ
    print("fp32: CUDA greedy == CPU greedy per request:", same)


def speculative_identity(dtype: str, model: Path, n: int, checks: Checks) -> None:
    same = speculative_matches_greedy(model, IDENTITY_PROMPTS, n)
    line = [f"{commit} k={k}: {'same' if ok else 'DIFFERENT'}" for (commit, k), ok in same.items()]
    for (commit, k), ok in same.items():
        checks.record(f"cuda_{dtype}_{commit}_k{k}_equals_greedy", ok)
    print(f"{dtype}: CUDA speculative vs CUDA greedy ({len(IDENTITY_PROMPTS)} requests x {n} tokens):", ", ".join(line))


def state_check(model: Path, checks: Checks, atol: float = 1e-5) -> None:
    """Scripted drafts (uniform accept lengths, and p=0.7), k = 1..4, select, each step in one Run
    (verify_mtp_k{k}) and in two (fused_verify=False); states vs a CUDA plain decode."""
    graphs = GraphSet(ortspec.Session(model, provider="cuda").manifest, provider="cuda")
    steps, prompts = 0, IDENTITY_PROMPTS[:3]
    for k in (1, 2, 3, 4):
        reference = plain_decode_states(graphs, prompts, 60 + k + 1, k)
        for p in (None, 0.7):
            for fused in (True, False):
                row_steps = state_check_row_steps(graphs, prompts, 60, k, "select", p=p, seed=k, reference=reference,
                                                  atol=atol, fused_verify=fused)
                steps += row_steps or 0
                checks.fail(row_steps is None)
    checks.results["cuda_state_check_row_steps"] = steps
    print(f"CUDA state check: {steps} row-steps checked (one-Run and two-Run steps), states within {atol} x "
          "(1 + the state's largest |value|) of the CUDA plain decode")


def memory_with_and_without_sharing(model_dir: Path) -> dict:
    """Device memory of the decode + verify + mtp sessions: weights shared through the native
    buffers (how ortspec runs) against each session loading its own copy from the files."""
    import gc

    import torch

    from ortspec.manifest import Manifest

    def used():
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return (total - free) / 2**20

    names = ["decode", "verify_select_k3", "mtp"]
    base = used()
    graphs = GraphSet(Manifest.load(model_dir), provider="cuda")
    graphs.load(names)
    shared = used() - base
    del graphs
    gc.collect()
    base = used()
    sessions = [ort.InferenceSession(str(model_dir / f"{n}.onnx"), custom_ops.session_options(),
                                     providers=["CUDAExecutionProvider"]) for n in names]
    private = used() - base
    del sessions
    weights = (model_dir / "weights.bin").stat().st_size / 2**20
    return {"weights_file": round(weights, 1), "shared_weights_3_sessions": round(shared, 1),
            "private_weights_3_sessions": round(private, 1)}


def graph_counters(model: Path, checks: Checks) -> None:
    """Batch 4 x 256 tokens, two calls per k: every slot captured once, then only replayed."""
    counters, steps_by_k = {}, {}
    for k in (1, 2, 3, 4):
        session = ortspec.Session(model, provider="cuda", num_speculative_tokens=k)
        for _ in range(2):  # the second call of the same batch size must only replay
            session.generate(IDENTITY_PROMPTS, max_new_tokens=256)
        steps_by_k[k] = session.stats["steps"]
        for slot, c in session.stats["graphs"].items():
            counters[f"k={k} {slot}"] = c
            checks.fail(c["fallbacks"] != 0 or c["invalidations"] != 0)
    checks.results["graph_counters"], checks.results["steps_by_k"] = counters, steps_by_k
    print(f"CUDA graph counters, batch 4 x 256 tokens x 2 calls per k (speculative steps per k: {steps_by_k}):")
    for slot, c in counters.items():
        print(f"  {slot:26s} {c}")


def benches(models: dict[str, Path], n: int, checks: Checks) -> dict[str, str]:
    tables = {}
    for label, model in models.items():
        start = time.perf_counter()
        bench = run_bench(model, ks=(0, 1, 2, 3, 4), batches=(1, 4), max_new_tokens=n, repeats=3, provider="cuda",
                          progress=False)
        checks.results[f"bench {label}"] = bench
        tables[label] = format_table(bench)
        print(f"bench {label} took {time.perf_counter() - start:.1f} s")
    return tables
