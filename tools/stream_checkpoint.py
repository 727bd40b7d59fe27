"""Write a random checkpoint of a real model's size tensor by tensor, straight into safetensors.

    python tools/stream_checkpoint.py OUT_DIR --preset qwen35-0.8b [--dtype float16] [--seed 0]

tools/make_tiny_checkpoint.py builds the whole transformers model in memory and then saves it:
fine at 20M parameters, but a 0.8B model in float32 is 3 GB of parameters plus the copies that
saving makes. Here the model is built on torch's meta device (names, shapes and owners only, no
memory), and each tensor is drawn (make_tiny_checkpoint's rules, in its order: the same seed
gives the same tensors as make_checkpoint), rounded to --dtype and written before the next is
drawn, so the peak is one tensor (the 248,320 x 1024 embedding: 1 GB while drawn in float32).

    OUT_DIR/model.safetensors      header first (every shape is known up front), then the data
    OUT_DIR/config.json, generation_config.json      as make_tiny_checkpoint writes them

No tokenizer (ids are the prompts) and no draft agreement (that edits tensors after drawing:
use make_checkpoint, or scripted drafts: ortspec bench --scripted-drafts, tools/gpu.py agree).
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.make_tiny_checkpoint import (  # noqa: E402
    DTYPES,
    FULL,
    LINEAR,
    MTPHead,
    _draw,
    build_config,
    write_config,
    write_generation_config,
)

# Qwen3.5-0.8B's published text config: 24 layers (3 GDN : 1 attention), tied embeddings, one MTP layer.
QWEN35_08B = dict(hidden_size=1024, intermediate_size=3584, vocab_size=248320, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                  linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                  partial_rotary_factor=0.25, rope_theta=10_000_000.0, tie_word_embeddings=True,
                  max_position_embeddings=262144, layer_types=(LINEAR, LINEAR, LINEAR, FULL) * 6)
PRESETS = {"qwen35-0.8b": QWEN35_08B}
_SAFETENSORS_DTYPE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def tensor_plan(config) -> list[tuple[str, torch.nn.Parameter, torch.nn.Module, bool]]:
    """(name as stored, meta parameter, its owner module, is an untied lm_head) in the order
    make_checkpoint draws them: the model's parameters by name, then the MTP head's ("mtp.*")."""
    with torch.device("meta"):
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

        model = Qwen3_5ForCausalLM(config)
        head = MTPHead(config) if getattr(config, "mtp_num_hidden_layers", 0) else None
    lm_head = None if config.tie_word_embeddings else model.lm_head
    plan = []
    for prefix, module in (("", model), ("mtp.", head)):
        if module is None:
            continue
        owners = {f"{m}.{p}".lstrip("."): sub for m, sub in module.named_modules()
                  for p, _ in sub.named_parameters(recurse=False)}
        for name, param in sorted(module.named_parameters(), key=lambda item: item[0]):
            plan.append((prefix + name, param, owners[name], owners[name] is lm_head))
    return plan


def safetensors_header(plan, dtype: str) -> bytes:
    """The file's header: 8-byte little-endian length, then the JSON (padded to 8 bytes) giving
    each tensor's dtype, shape and byte range, back to back in plan order."""
    itemsize = torch.empty((), dtype=DTYPES[dtype]).element_size()
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, param, _, _ in plan:
        size = param.numel() * itemsize
        entries[name] = {"dtype": _SAFETENSORS_DTYPE[dtype], "shape": list(param.shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_random_checkpoint(out_dir, *, seed: int = 0, dtype: str = "float16", mtp: bool = True,
                            **dims) -> Path:
    """Writes the checkpoint (any make_checkpoint dimension in dims) and returns out_dir."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: use one of {sorted(DTYPES)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*out_dir.glob("model*.safetensors"), out_dir / "model.safetensors.index.json",
                  out_dir / "config.json"]:
        stale.unlink(missing_ok=True)
    config = build_config(mtp=mtp, dtype=dtype, **dims)
    plan = tensor_plan(config)
    generator = torch.Generator().manual_seed(seed)
    partial = out_dir / "model.safetensors.partial"
    with open(partial, "wb") as f:
        f.write(safetensors_header(plan, dtype))
        for name, param, owner, is_lm_head in plan:
            drawn = _draw(name, param, owner, generator, is_lm_head=is_lm_head)  # float32, one tensor
            f.write(drawn.to(DTYPES[dtype]).contiguous().view(torch.uint8).numpy().data)
            del drawn
    partial.chmod(0o644)
    partial.replace(out_dir / "model.safetensors")
    write_generation_config(config, out_dir)
    write_config(config, out_dir, nested=False)  # last: a finished checkpoint has config.json
    return out_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen35-0.8b")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float16",
                        help="stored dtype (ortspec convert --dtype float32 reads float16 too)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-mtp", dest="mtp", action="store_false", help="leave out mtp.* weights")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = write_random_checkpoint(args.out_dir, seed=args.seed, dtype=args.dtype, mtp=args.mtp,
                                  **PRESETS[args.preset])
    size = (out / "model.safetensors").stat().st_size
    print(f"wrote {out} ({size / 2**30:.2f} GiB, {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
