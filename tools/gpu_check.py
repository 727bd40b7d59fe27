"""GPU host check: CUDA-provider correctness against the CPU and greedy, then tokens/s.

    python tools/gpu_check.py [--out DIR] [--new-tokens 64]

Needs onnxruntime-gpu and ortspec._native built with CUDA. Converts models/tiny-qwen35,
then checks (1) CUDA greedy vs CPU greedy tokens, (2) CUDA speculative (k = 1..4, select)
vs CUDA greedy tokens, (3) the scripted-draft state check on CUDA (states after every
commit vs a CUDA plain decode, within a tolerance), and (4) greedy vs speculative tokens/s
side by side. Prints a short table last; exits non-zero if any identity check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import onnxruntime as ort  # noqa: E402

import ortspec  # noqa: E402
from ortspec import _native  # noqa: E402
from ortspec.bench import format_table, run_bench  # noqa: E402
from ortspec.runtime.graphs import GraphSet  # noqa: E402
from ortspec.speculative.exactness import ExactnessError, check_speculative, plain_decode_states  # noqa: E402
from tools.make_tiny_checkpoint import make_checkpoint  # noqa: E402

# a larger random model in the Qwen3.5 layout (3 GDN : 1 attention), for memory and speed
MEDIUM = dict(hidden_size=1024, intermediate_size=2816, vocab_size=8192, num_attention_heads=8,
              num_key_value_heads=2, head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16,
              linear_key_head_dim=64, linear_value_head_dim=64,
              layer_types=("linear_attention", "linear_attention", "linear_attention", "full_attention") * 2)


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
    sessions = [ort.InferenceSession(str(model_dir / f"{n}.onnx"), providers=["CUDAExecutionProvider"]) for n in names]
    private = used() - base
    del sessions
    weights = (model_dir / "weights.bin").stat().st_size / 2**20
    return {"weights_file": round(weights, 1), "shared_weights_3_sessions": round(shared, 1),
            "private_weights_3_sessions": round(private, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/ortspec_gpu_check")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-bench", action="store_true", help="identity, state and graph checks only")
    args = parser.parse_args(argv)
    ort.set_default_logger_severity(3)
    print("onnxruntime", ort.__version__, ort.get_available_providers())
    print("native", json.dumps(_native.build_info()))
    out = Path(args.out)
    ortspec.convert(ROOT / "models" / "tiny-qwen35", out, num_speculative_tokens=4, max_length=512,
                    overwrite=True, progress=False)
    prompts = [[5, 17, 99, 3, 250, 7, 11], [42], [8, 8, 8, 300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [900, 1]]
    n = args.new_tokens
    results, failures = {}, 0

    cpu = ortspec.Session(out).generate(prompts, max_new_tokens=n)
    gpu = ortspec.Session(out, provider="cuda").generate(prompts, max_new_tokens=n)
    same = [a == b for a, b in zip(cpu, gpu)]
    results["cuda_greedy_equals_cpu_greedy"] = same
    print("fp32: CUDA greedy == CPU greedy per request:", same)
    for dtype in ("float32", "float16", "bfloat16"):
        model = out if dtype == "float32" else Path(f"{args.out}_{dtype}")
        if dtype != "float32":
            ortspec.convert(ROOT / "models" / "tiny-qwen35", model, num_speculative_tokens=4, max_length=512,
                            dtype=dtype, overwrite=True, progress=False)
        greedy = ortspec.Session(model, provider="cuda").generate(prompts, max_new_tokens=n)
        line = []
        for commit in ("select", "readvance"):
            for k in (1, 2, 3, 4):
                spec = ortspec.Session(model, provider="cuda", num_speculative_tokens=k, commit=commit).generate(
                    prompts, max_new_tokens=n)
                ok = spec == greedy
                failures += not ok
                results[f"cuda_{dtype}_{commit}_k{k}_equals_greedy"] = ok
                line.append(f"{commit} k={k}: {'same' if ok else 'DIFFERENT'}")
        print(f"{dtype}: CUDA speculative vs CUDA greedy ({len(prompts)} requests x {n} tokens):", ", ".join(line))

    graphs = GraphSet(ortspec.Session(out, provider="cuda").manifest, provider="cuda")
    steps, atol = 0, 1e-5
    for k in (1, 2, 3, 4):
        reference = plain_decode_states(graphs, prompts[:3], 60 + k + 1, k)
        for p in (None, 0.7):
            try:
                stats = check_speculative(graphs, prompts[:3], 60, k, "select", p=p, seed=k, reference=reference,
                                          atol=atol)
                steps += stats.speculative_steps
            except ExactnessError as error:
                failures += 1
                print("STATE CHECK FAILED:", error)
    results["cuda_state_check_row_steps"] = steps
    print(f"CUDA state check: {steps} row-steps checked, states within {atol} of the CUDA plain decode")

    medium = Path(args.out + "_medium")
    make_checkpoint(medium / "ck", seed=7, draft_agreement=10.0, **MEDIUM)
    ortspec.convert(medium / "ck", medium / "out", num_speculative_tokens=4, max_length=512,
                    overwrite=True, progress=False)
    ortspec.convert(medium / "ck", medium / "out_fp16", num_speculative_tokens=4, max_length=512, dtype="float16",
                    overwrite=True, progress=False)
    results["memory_mib"] = memory_with_and_without_sharing(medium / "out")
    print("device memory (MiB):", results["memory_mib"])

    counters, steps_by_k = {}, {}
    for k in (1, 2, 3, 4):
        session = ortspec.Session(out, provider="cuda", num_speculative_tokens=k)
        for _ in range(2):  # the second call of the same batch size must only replay
            session.generate(prompts, max_new_tokens=256)
        steps_by_k[k] = session.stats["steps"]
        for slot, c in session.stats["graphs"].items():
            counters[f"k={k} {slot}"] = c
            failures += c["fallbacks"] != 0 or c["invalidations"] != 0
    results["graph_counters"], results["steps_by_k"] = counters, steps_by_k
    print(f"CUDA graph counters, batch 4 x 256 tokens x 2 calls per k (speculative steps per k: {steps_by_k}):")
    for slot, c in counters.items():
        print(f"  {slot:26s} {c}")

    tables = {}
    benches = (("tiny-qwen35", out), ("medium (116M params, random), fp32", medium / "out"),
               ("medium (116M params, random), fp16", medium / "out_fp16"))
    for label, model in benches if not args.no_bench else ():
        start = time.perf_counter()
        bench = run_bench(model, ks=(0, 1, 2, 3, 4), batches=(1, 4), max_new_tokens=n, repeats=3, provider="cuda",
                          progress=False)
        results[f"bench {label}"] = bench
        tables[label] = format_table(bench)
        print(f"bench {label} took {time.perf_counter() - start:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    for label, table in tables.items():
        print(f"\n### {label}, CUDA\n{table}")
    print("identity failures:", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
