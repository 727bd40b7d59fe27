"""The trained model as an HF-layout checkpoint that `ortspec convert` takes unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from tools.make_tiny_checkpoint import checkpoint_tensors, write_config, write_generation_config
from tools.training.corpus import write_tokenizer

MAX_SHARD_BYTES = 15 * 2**20  # every safetensors file <= 15 MiB: small enough to bring back file by file


def write_sharded(tensors: dict[str, torch.Tensor], out_dir: Path, max_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """Name-ordered shards, each file <= max_bytes, + model.safetensors.index.json covering every key."""
    headroom = min(64 * 1024, max_bytes // 16)  # the safetensors JSON header
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > max_bytes - headroom:
            raise ValueError(f"{name} alone is {nbytes} bytes, more than a {max_bytes}-byte shard holds")
        if groups[-1] and size + nbytes > max_bytes - headroom:
            groups.append({})
            size = 0
        groups[-1][name] = tensor
        size += nbytes
    weight_map, paths = {}, []
    for i, part in enumerate(groups):
        file_name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        path = out_dir / file_name
        save_file(part, str(path), metadata={"format": "pt"})
        path.chmod(0o644)
        if path.stat().st_size > max_bytes:
            raise RuntimeError(f"{path} is {path.stat().st_size} bytes > {max_bytes}")
        weight_map.update(dict.fromkeys(part, file_name))
        paths.append(path)
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return paths


def write_checkpoint(model, mtp, tokenizer, out_dir: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    for stale in [*out_dir.glob("model*.safetensors"), out_dir / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    mtp_tensors = {k: v.detach().cpu() for k, v in mtp.tensors().items()}
    tensors = checkpoint_tensors(model.cpu(), mtp_tensors, nested=False, dtype="float16")
    paths = write_sharded(tensors, out_dir, max_shard_bytes)
    write_config(model.config, out_dir, nested=False)
    write_generation_config(model.config, out_dir)
    write_tokenizer(tokenizer, out_dir, model.config.max_position_embeddings)
    return paths


@torch.no_grad()
def round_to_float16_(*modules: nn.Module) -> None:
    """Make the in-memory weights equal what the float16 checkpoint stores."""
    for module in modules:
        for param in module.parameters():
            param.copy_(param.to(torch.float16).float())
