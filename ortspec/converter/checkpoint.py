"""Reads weights from a HuggingFace checkpoint's safetensors files, single or sharded.

HF's own loader drops the ``mtp.*`` keys of Qwen3.5 checkpoints, so ortspec reads the
files directly. Target weights live under ``model.`` (Qwen3_5ForCausalLM) or
``model.language_model.`` (the multimodal Qwen3_5ForConditionalGeneration layout);
``lm_head.weight`` and ``mtp.*`` sit at the top level in both.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import CheckpointError, CheckpointNotFoundError, WeightError

_TARGET_PREFIXES = ("model.language_model.", "model.")


class CheckpointReader:
    """Maps weight names to safetensors files and loads them as float32 numpy arrays."""

    def __init__(self, checkpoint_dir: str | Path):
        self.dir = Path(checkpoint_dir)
        self._file_of = self._index_files()
        self._target_prefix = self._detect_target_prefix()

    def _index_files(self) -> dict[str, Path]:
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = {name: self.dir / fname for name, fname in weight_map.items()}
            missing = sorted({str(f) for f in files.values() if not f.is_file()})
            if missing:
                raise CheckpointNotFoundError(
                    f"model.safetensors.index.json names shard files that are missing: {missing}. "
                    "Download every shard of the checkpoint."
                )
            return files
        shards = sorted(self.dir.glob("*.safetensors"))
        if not shards:
            raise CheckpointNotFoundError(
                f"{str(self.dir)!r} has no *.safetensors files; ortspec reads safetensors weights "
                "(convert .bin checkpoints with transformers' save_pretrained first)."
            )
        from safetensors import safe_open

        files = {}
        for shard in shards:
            with safe_open(str(shard), framework="np") as f:
                for name in f.keys():
                    files[name] = shard
        return files

    def _detect_target_prefix(self) -> str:
        for prefix in _TARGET_PREFIXES:
            if f"{prefix}embed_tokens.weight" in self._file_of:
                return prefix
        raise WeightError(
            "no embedding weight found (looked for 'model.embed_tokens.weight' and "
            "'model.language_model.embed_tokens.weight'); is this a Qwen3.5 checkpoint?"
        )

    def has(self, name: str) -> bool:
        return self._resolve(name) in self._file_of

    def has_mtp(self) -> bool:
        return any(name.startswith("mtp.") for name in self._file_of)

    def _resolve(self, name: str) -> str:
        """Target weights are named without prefix (``layers.0.mlp...``); ``mtp.*``/``lm_head.*`` as is."""
        if name.startswith(("mtp.", "lm_head.")):
            return name
        return self._target_prefix + name

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Returns the weight as a float32 array, checking its shape against the config."""
        key = self._resolve(name)
        path = self._file_of.get(key)
        if path is None:
            raise WeightError(
                f"weight {key!r} is missing from the checkpoint's safetensors files; the config "
                f"expects it with shape {list(shape)}. The checkpoint is incomplete or of another layout."
            )
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            tensor = f.get_tensor(key)
        if tuple(tensor.shape) != tuple(shape):
            raise WeightError(
                f"weight {key!r} has shape {list(tensor.shape)} but config.json implies {list(shape)}; "
                "the weights do not match config.json."
            )
        try:
            return tensor.float().numpy()
        except Exception as exc:  # pragma: no cover - dtype torch cannot convert
            raise CheckpointError(f"weight {key!r} of dtype {tensor.dtype} cannot be read: {exc}") from exc
