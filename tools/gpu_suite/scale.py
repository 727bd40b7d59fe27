"""The memory-bound regime, and measured kernel times per step (was tools/gpu_scale.py).

(1) LARGE, a random 0.9B-parameter model in the Qwen3.5 layout (hidden 2048, 12 layers,
    3 GDN : 1 attention, vocab 32k, tied embeddings, MTP head), converted to fp16: decode
    (M=1) and verify (M=k+1) step times at batch 1/4/16, each against its bandwidth floor:
    the bytes one step must move (weights it reads, states it reads and writes) over the
    device-to-device copy rate measured here.
(2) Kernel profile (torch.profiler, i.e. CUPTI, which sees ONNX Runtime's kernels inside
    replayed CUDA graphs): kernels per step, their summed GPU time, the wall time per step
    and the fraction of it the GPU is busy, for the trained 20M model and LARGE.
Tables last.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

import ortspec
from ortspec.bench import run_bench
from ortspec.manifest import Manifest, graph_name

from .common import STEP_PROMPT, TRAINED, convert, markdown_table, random_checkpoint, write_json

SUMMARY = "a 1B random model against the bandwidth floor, and kernels per step (torch.profiler)"


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="/tmp/ortspec_gpu_scale", help="working directory (converted models)")
    parser.add_argument("--trained", default=str(TRAINED), help="the trained checkpoint to profile beside LARGE")


def run(args) -> int:
    out = Path(args.out)
    bandwidth = copy_bandwidth()
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    start = time.perf_counter()
    large = build_large(out)
    params = sum(int(np.prod(e["shape"])) for e in Manifest.load(large).weights.values())
    print(f"LARGE: {params / 1e9:.2f}B parameters (MTP head included), checkpoint + convert "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    trained = convert(args.trained, out / "trained_fp16", dtype="float16")
    bench, table = memory_bound(large, bandwidth)
    profiles = [kernel_profile(model, k, b) for model in (trained, large) for k in (0, 2) for b in (1, 16)]
    write_json(args.json, {"bandwidth_bytes_per_s": bandwidth, "large_params": params, "large_bench": bench,
                           "kernel_profiles": profiles})
    print(f"\n### LARGE ({params / 1e9:.2f}B, random, fp16): step time against the bandwidth floor "
          f"({bandwidth / 1e12:.2f} TB/s measured)\n")
    print(table)
    print("\n### Kernel profile per step (CUPTI via torch.profiler; CUDA graphs replayed)\n")
    print(profile_table(profiles))
    return 0


def build_large(out: Path, dtype: str = "float16", preset: str = "large", draft_vocab="auto") -> Path:
    """LARGE as this subcommand runs it (tools/gpu.py agree too): the random checkpoint (its
    preset's seed) in out/large_ck, converted in out/large_fp16 (float16) or out/large_{dtype}.
    preset: another random model (common.PRESETS, common.STREAMED) in out/{preset}_ck and
    out/{preset}_fp16 or out/{preset}_{dtype}; draft_vocab: convert's (LARGE's 32,768 tokens
    take none by default, Qwen3.5-0.8B's 248,320 the default 32,768)."""
    converted = f"{preset}_fp16" if dtype == "float16" else f"{preset}_{dtype}"
    return convert(random_checkpoint(out / f"{preset}_ck", preset), out / converted, dtype=dtype,
                   draft_vocab=draft_vocab)


def copy_bandwidth() -> float:
    """Bytes moved per second (read + write) by a 2 GiB device-to-device copy: the rate a
    step that streams its weights can reach at best."""
    import torch

    src = torch.empty(2**30, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    stop.record()
    torch.cuda.synchronize()
    return 20 * 2 * src.nbytes / (start.elapsed_time(stop) / 1000)


def step_bytes(manifest: Manifest, graph: str, batch: int, rows: int, windows: bool) -> int:
    """Bytes one forward must move: every weight its graph reads (the embedding table fully,
    since the tied lm_head reads it), plus per request the GDN states read and written (a
    select verify writes the state after each of its rows) and the KV cache it reads (our
    attention reads every slot) and the KV rows it writes."""
    weights = sum(manifest.weights[n]["length"] for n in manifest.graphs[graph]["weights"] if n in manifest.weights)
    per_row = 0
    for entry in manifest.states.values():
        size = 4 * int(np.prod(entry["shape"][1:]))
        if entry["layer"] == "mtp":
            continue
        if entry["kind"] in ("conv", "recurrent"):
            per_row += size * (1 + (rows if windows else 1))
        else:  # kv_key / kv_value: read all L slots, write `rows` rows
            per_row += size + size // manifest.max_length * rows
    return weights + batch * per_row


def memory_bound(model: Path, bandwidth: float) -> tuple[dict, str]:
    result = run_bench(model, ks=(0, 1, 2, 3), batches=(1, 4, 16), max_new_tokens=48, repeats=3,
                       provider="cuda", progress=False)
    manifest, lines = Manifest.load(model), []
    for r in result["rows"]:
        k, b = r["k"], r["batch"]
        ms = r["phase_ms"]["decode"] / r["decode_steps"] if k == 0 else r["phase_ms"]["verify"] / r["speculative_steps"]
        graph = "decode" if k == 0 else graph_name("verify_select", k)
        floor = 1000 * step_bytes(manifest, graph, b, k + 1, windows=k > 0) / bandwidth
        r["floor_ms"], r["step_ms"] = floor, ms
        lines.append([b, "greedy decode" if k == 0 else f"verify k={k}", k + 1, f"{ms:.3f}", f"{floor:.3f}",
                      f"{100 * floor / ms:.0f}%", f"{r['tokens_per_second']:.0f}"])
    header = ["batch", "step", "rows", "measured ms", "floor ms", "% of floor", "tokens/s"]
    return result, markdown_table(header, lines)


def busy_time(spans: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: the time at least one kernel ran."""
    busy, end = 0.0, -float("inf")
    for s, e in sorted(spans):
        if s > end:
            busy, end = busy + (e - s), e
        elif e > end:
            busy, end = busy + (e - end), e
    return busy


def kernel_profile(model: Path, k: int, batch: int, steps: int = 24) -> dict:
    """Kernels per step and GPU busy time, over `steps` steps after warm-up (graphs captured)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    session = ortspec.Session(model, provider="cuda", num_speculative_tokens=k)
    batcher = session.batcher(max_batch_size=batch)
    for _ in range(batch):
        batcher.add_request(STEP_PROMPT, max_new_tokens=(k + 1) * (3 * steps + 8))
    for _ in range(4):
        batcher.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        batcher.step()
    wall = (time.perf_counter() - start) / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            batcher.step()
        torch.cuda.synchronize()
    device_events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    is_copy = [any(s in e.name.lower() for s in ("memcpy", "memset")) for e in device_events]
    kernels = [e for e, c in zip(device_events, is_copy) if not c]
    busy = busy_time([(e.time_range.start, e.time_range.end) for e in kernels])
    total = sum(e.time_range.elapsed_us() for e in kernels)
    return {"model": model.name, "k": k, "batch": batch, "kernels_per_step": len(kernels) / steps,
            "copies_per_step": sum(is_copy) / steps, "kernel_us_per_step": total / steps,
            "mean_us_per_kernel": total / max(1, len(kernels)), "busy_us_per_step": busy / steps,
            "wall_us_per_step": 1e6 * wall}


def profile_table(profiles: list[dict]) -> str:
    header = ["model", "k", "batch", "kernels/step", "kernel us/step", "mean us/kernel", "GPU busy us/step",
              "wall us/step", "busy %"]
    return markdown_table(header, [
        [p["model"], p["k"], p["batch"], f"{p['kernels_per_step']:.0f}", f"{p['kernel_us_per_step']:.0f}",
         f"{p['mean_us_per_kernel']:.2f}", f"{p['busy_us_per_step']:.0f}", f"{p['wall_us_per_step']:.0f}",
         f"{100 * p['busy_us_per_step'] / p['wall_us_per_step']:.0f}%"] for p in profiles])
