"""Where a token's GPU time goes, kernel by kernel (issue 11: what would close the floor gap).

``scale`` counts kernels and GPU-busy time per step; this breaks that time down by kernel name,
over a whole ``generate`` call as a user runs it (pipelined greedy or pipelined speculation on
CUDA, graphs replayed), after a warm-up call of the same shape. Per configuration: the kernels
grouped by name (calls and microseconds per token, share of all kernel time), each name put in
a class (GEMV/GEMM, attention, GDN recurrence pieces, normalisation, element-wise, reductions,
copies), the classes summed, and the whole against the bandwidth floor of a decode step (the
weights it reads and the states it moves, over the measured copy rate: ``scale.step_bytes``).
Tables last.
"""

from __future__ import annotations

import collections
import re
import time
from pathlib import Path

import ortspec
from ortspec.manifest import Manifest

from .common import CODE_PROMPTS, TRAINED, convert, markdown_table, write_json
from .scale import build_large, busy_time, copy_bandwidth, step_bytes

SUMMARY = "GPU time per token by kernel name and class over a generate call (torch.profiler)"

# (class, pattern on the lower-cased kernel name), first match wins; the order matters: cuBLAS's
# split-K GEMM pieces before ONNX Runtime's Split, the GDN kernels ("LinearAttention...") before attention
CLASSES = [("ortspec native", r"ortspec"),
           ("fp32 products (attention)", r"f32f32|gemmsn_nn_kernel<float|gemv\w*<[^>]*float"),
           ("gemv/gemm (weights)", r"nvjet|cublaslt|gemv|gemm|cutlass|xmma|matmul"),
           ("GDN (recurrence, conv)", r"linearattention|causalconv"),
           ("attention (softmax, rotary)", r"softmax|rotary|attention|flash|mha"),
           ("normalisation", r"layernorm|rmsnorm|norm"),
           ("cast", r"cast"),
           ("split/concat/copies", r"split|concat|copy|memcpy|memset|transpose|slice|gather|scatter|expand|tile"),
           ("reduction", r"reduce|arg_?m|topk"),
           ("element-wise", r"elementwise|unary|binary|silu|sigmoid|where|mul|add")]


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="/tmp/ortspec_gpu_kernels", help="working directory (converted models)")
    parser.add_argument("--models", default="trained,large", help="comma-separated: trained, large, or paths")
    parser.add_argument("-k", "--k", default="0,3", help="comma-separated k values")
    parser.add_argument("--batch", default="1", help="comma-separated batch sizes")
    parser.add_argument("--new-tokens", type=int, default=96, help="tokens per request in the profiled call")
    parser.add_argument("--top", type=int, default=15, help="kernel names listed per configuration")


def run(args) -> int:
    out = Path(args.out)
    bandwidth = copy_bandwidth()
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    models = [model_path(name, out) for name in args.models.split(",")]
    results = []
    for model in models:
        for k in (int(x) for x in args.k.split(",")):
            for batch in (int(x) for x in args.batch.split(",")):
                results.append(profile_generate(model, k, batch, args.new_tokens, bandwidth))
    write_json(args.json, {"bandwidth_bytes_per_s": bandwidth, "profiles": results})
    for r in results:
        print(f"\n### {r['model']} k={r['k']} batch {r['batch']}: {r['wall_us_per_token']:.0f} us per token "
              f"(wall), kernels {r['kernel_us_per_token']:.0f} us in {r['kernels_per_token']:.0f} launches, "
              f"GPU busy {r['busy_percent']:.0f}%, decode floor {r['floor_us']:.0f} us per step "
              f"({r['tokens_per_step']:.2f} tokens per step)\n")
        print(markdown_table(["class", "kernels/token", "us/token", "share"],
                             [[c["class"], f"{c['calls_per_token']:.1f}", f"{c['us_per_token']:.1f}",
                               f"{100 * c['share']:.0f}%"] for c in r["classes"]]))
        print()
        print(markdown_table(["kernel", "class", "calls/token", "us/token", "us/call", "share"],
                             [[n["name"][:90], n["class"], f"{n['calls_per_token']:.1f}", f"{n['us_per_token']:.1f}",
                               f"{n['us_per_call']:.2f}", f"{100 * n['share']:.0f}%"] for n in r["names"][:args.top]]))
    return 0


def model_path(name: str, out: Path) -> Path:
    if name == "trained":
        return convert(TRAINED, out / "trained_fp16", dtype="float16", max_length=1024)
    if name == "large":
        return build_large(out)
    return Path(name)


def kernel_class(name: str) -> str:
    lower = name.lower()
    return next((label for label, pattern in CLASSES if re.search(pattern, lower)), "other")


def profile_generate(model: Path, k: int, batch: int, new_tokens: int, bandwidth: float) -> dict:
    """One generate call of `batch` prompts x `new_tokens` under CUPTI, after an unprofiled one."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    session = ortspec.Session(model, provider="cuda", num_speculative_tokens=k)
    prompts = [CODE_PROMPTS[j % len(CODE_PROMPTS)] for j in range(batch)] if model.name.startswith("trained") else \
        [[11 + j, 7, 3, 250, 99, 17, 5, 42] for j in range(batch)]
    session.generate(prompts, max_new_tokens=new_tokens)  # warm-up: every graph captured
    torch.cuda.synchronize()
    start = time.perf_counter()
    session.generate(prompts, max_new_tokens=new_tokens)
    wall = time.perf_counter() - start
    before = session.stats
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        session.generate(prompts, max_new_tokens=new_tokens)
        torch.cuda.synchronize()
    stats = session.stats
    tokens = batch * new_tokens
    steps = (stats["decode_steps"] - before["decode_steps"]) + (stats["speculative_steps"] - before["speculative_steps"])
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        by_name[e.name].append(e.time_range.elapsed_us())
    total = sum(sum(v) for v in by_name.values())
    names = sorted(({"name": n, "class": kernel_class(n), "calls_per_token": len(v) / tokens,
                     "us_per_token": sum(v) / tokens, "us_per_call": sum(v) / len(v), "share": sum(v) / total}
                    for n, v in by_name.items()), key=lambda r: -r["us_per_token"])
    classes: dict[str, dict] = {}
    for n in names:
        c = classes.setdefault(n["class"], {"class": n["class"], "calls_per_token": 0.0, "us_per_token": 0.0,
                                            "share": 0.0})
        for key in ("calls_per_token", "us_per_token", "share"):
            c[key] += n[key]
    busy = busy_time([(e.time_range.start, e.time_range.end) for e in events])
    floor = 1e6 * step_bytes(Manifest.load(model), "decode", batch, 1, windows=False) / bandwidth
    return {"model": model.name, "k": k, "batch": batch, "tokens": tokens, "steps": steps,
            "tokens_per_step": tokens / max(1, steps), "wall_us_per_token": 1e6 * wall / tokens,
            "kernels_per_token": sum(len(v) for v in by_name.values()) / tokens,
            "kernel_us_per_token": total / tokens, "busy_percent": 100 * busy / (1e6 * wall),
            "floor_us": floor, "classes": sorted(classes.values(), key=lambda c: -c["us_per_token"]), "names": names}
