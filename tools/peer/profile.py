"""One kernel profiler for both runtimes, and the bandwidth floor they are measured against.

torch.profiler with the CUDA activity is CUPTI: it records every kernel launched in the process
on any stream, ONNX Runtime's (both runtimes run on it) and those inside replayed CUDA graphs
included; kernels == 0 for a configuration would mean it did not see them (reported as such).

Per configuration (one prompt, batch 1): kernels per token, summed kernel time per token, the
GPU-busy time per token (the union of kernel intervals, so overlapping kernels count once) and
its share of the wall time of the same run without the profiler.

Bandwidth floor per generated token (greedy): the bytes a decode step must read, over the
device-to-device copy rate measured here (tools/gpu_suite/scale.copy_bandwidth):

    weights   every target tensor at 2 bytes (fp16), the embedding table only when tied (the
              lm_head then reads it whole; otherwise a decode reads one row); mtp.* left out
    kv        full-attention layers x (K and V) x kv heads x head_dim x 2 bytes x context
    states    GDN recurrent (value heads x d_k x d_v) and conv (conv channels x (kernel - 1))
              states, fp32, read and written once per token
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

from .relayout import text_config_of


def tensor_numels(checkpoint: Path) -> dict[str, int]:
    """name -> element count, from the safetensors headers (no tensor is read)."""
    numels = {}
    for path in sorted(Path(checkpoint).glob("*.safetensors")):
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= dim
                numels[name] = count
    return numels


def floor_bytes_per_token(checkpoint: Path, context: int) -> dict:
    """The bytes one greedy decode step reads at `context` tokens of KV cache (module docstring)."""
    config = text_config_of(json.loads((Path(checkpoint) / "config.json").read_text()))
    tied = bool(config.get("tie_word_embeddings", False))
    weights = sum(2 * n for name, n in tensor_numels(checkpoint).items()
                  if not name.startswith("mtp.") and (tied or not name.endswith("embed_tokens.weight")))
    kinds = config["layer_types"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv = kinds.count("full_attention") * 2 * config["num_key_value_heads"] * head_dim * 2 * context
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    kh, vh = config["linear_num_key_heads"], config["linear_num_value_heads"]
    per_layer = vh * dk * dv + (2 * kh * dk + vh * dv) * (config.get("linear_conv_kernel_dim", 4) - 1)
    states = kinds.count("linear_attention") * per_layer * 4 * 2
    return {"weights": weights, "kv": kv, "states": states, "total": weights + kv + states, "context": context}


def busy_time(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total


def kernel_profile(generate) -> dict:
    """Profile one call of `generate()` (returns the number of new tokens); per-token figures.
    The wall time comes from an identical call just before, without the profiler."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = generate()
    torch.cuda.synchronize()
    wall_us = 1e6 * (time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        generate()
        torch.cuda.synchronize()
    device = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    kernels = [e for e in device if not any(s in e.name.lower() for s in ("memcpy", "memset"))]
    kernel_us = sum(e.time_range.elapsed_us() for e in kernels)
    busy_us = busy_time([(e.time_range.start, e.time_range.end) for e in kernels])
    n = max(1, tokens)
    return {"tokens": tokens, "kernels_per_token": len(kernels) / n,
            "copies_per_token": (len(device) - len(kernels)) / n, "kernel_us_per_token": kernel_us / n,
            "busy_us_per_token": busy_us / n, "wall_us_per_token": wall_us / n,
            "gpu_busy_share": busy_us / wall_us if wall_us else None, "profiler_saw_kernels": bool(kernels)}


def against_floor(profile: dict, floor_bytes: int, bandwidth: float) -> dict:
    """Kernel time and wall time per token as multiples of the floor time per token."""
    floor_us = 1e6 * floor_bytes / bandwidth
    return {"floor_us_per_token": floor_us, "kernel_over_floor": profile["kernel_us_per_token"] / floor_us,
            "floor_share_of_wall": floor_us / profile["wall_us_per_token"]}
