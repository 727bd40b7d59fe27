"""Reads weights from a HuggingFace checkpoint's safetensors files, single or sharded.

HF's own loader drops the ``mtp.*`` keys of Qwen3.5 checkpoints, so ortspec reads the
files directly. Target weights live under ``model.`` (Qwen3_5ForCausalLM) or
``model.language_model.`` (the multimodal Qwen3_5ForConditionalGeneration layout);
``lm_head.weight`` and ``mtp.*`` sit at the top level in both.

Every tensor is read once and checked: shape against config.json, a floating-point dtype (an
int32 up_proj used to convert silently into other tokens), and every value finite (a NaN
weight used to convert fine and then generate only EOS). A shard that is cut short or not
safetensors at all, an index whose weight_map is not names -> shard files in this directory,
and a tokenizer.json that the tokenizers package cannot load are CheckpointErrors naming the
file (and the key); shards' headers and the tokenizer are read up front, before any work.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np

from ..errors import CheckpointError, CheckpointNotFoundError, WeightError

_TARGET_PREFIXES = ("model.language_model.", "model.")
_FINITE_CHUNK = 1 << 20  # elements per isfinite call: a 1 MiB temporary that stays in cache


class CheckpointReader:
    """Maps weight names to safetensors files and loads them as float32 numpy arrays."""

    def __init__(self, checkpoint_dir: str | Path):
        self.dir = Path(checkpoint_dir)
        self._file_of = self._index_files()
        self._target_prefix = self._detect_target_prefix()

    def _index_files(self) -> dict[str, Path]:
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            files = {name: self.dir / fname for name, fname in _read_weight_map(index).items()}
            missing = sorted({str(f) for f in files.values() if not f.is_file()})
            if missing:
                raise CheckpointNotFoundError(
                    f"model.safetensors.index.json names shard files that are missing: {missing}. "
                    "Download every shard of the checkpoint."
                )
            for shard in sorted(set(files.values())):
                with _open_shard(shard, "np"):  # reads the header only: a cut-short shard fails here
                    pass
            return files
        shards = sorted(self.dir.glob("*.safetensors"))
        if not shards:
            raise CheckpointNotFoundError(
                f"{str(self.dir)!r} has no *.safetensors files; ortspec reads safetensors weights "
                "(convert .bin checkpoints with transformers' save_pretrained first)."
            )
        files = {}
        for shard in shards:
            with _open_shard(shard, "np") as f:
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
        with _open_shard(path, "pt") as f:
            tensor = f.get_tensor(key)
        if not tensor.dtype.is_floating_point:
            raise WeightError(
                f"weight {key!r} in {path.name} has dtype {str(tensor.dtype).removeprefix('torch.')}, not a floating-"
                "point dtype: converted as numbers it would make another model. Quantized checkpoints (integer "
                "weights with scales) are not supported; use the checkpoint's float32/float16/bfloat16 weights.")
        if tuple(tensor.shape) != tuple(shape):
            raise WeightError(
                f"weight {key!r} has shape {list(tensor.shape)} but config.json implies {list(shape)}; "
                "the weights do not match config.json."
            )
        try:
            array = tensor.float().numpy()
        except Exception as exc:  # pragma: no cover - dtype torch cannot convert
            raise CheckpointError(f"weight {key!r} of dtype {tensor.dtype} cannot be read: {exc}") from exc
        check_finite(key, array)
        return array


def check_finite(key: str, array: np.ndarray) -> None:
    """Raises WeightError naming the tensor if any value is NaN or Inf. Checked in chunks, so a
    multi-gigabyte tensor costs no full-size temporary (only the failing case counts them all)."""
    flat = array.reshape(-1)
    for start in range(0, flat.size, _FINITE_CHUNK):
        if not np.isfinite(flat[start:start + _FINITE_CHUNK]).all():
            bad = np.flatnonzero(~np.isfinite(flat))
            first = [int(i) for i in np.unravel_index(bad[0], array.shape)]
            raise WeightError(
                f"weight {key!r} has {bad.size} non-finite values (NaN or Inf), the first at index {first}: the "
                "checkpoint is corrupt or was saved from a diverged training run, and a model made from it would "
                "generate garbage. Use a checkpoint whose weights are all finite.")


def _read_weight_map(index: Path) -> dict[str, str]:
    """weight name -> shard file name (a plain name in the checkpoint directory), checked."""
    try:
        document = json.loads(index.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{index} cannot be read as a safetensors index ({exc}); download it again.") from None
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index} has no 'weight_map' object; download the checkpoint's index again.")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or Path(shard).name != shard:
            raise CheckpointError(f"{index}: weight_map[{name!r}] is {json.dumps(shard)[:60]}, not the name of a shard "
                                  "file in the checkpoint directory (a string such as \"model-00001-of-00002."
                                  "safetensors\"); download the checkpoint's index again.")
    return weight_map


def check_tokenizer(checkpoint_dir: Path, vocab_size: int) -> None:
    """A tokenizer.json must load (tokenizers) and fit the vocabulary; tokenizer_config.json must be a
    JSON object. Either may be absent (token-id prompts only, no chat template)."""
    tokenizer, config = checkpoint_dir / "tokenizer.json", checkpoint_dir / "tokenizer_config.json"
    if tokenizer.is_file():
        from tokenizers import Tokenizer

        try:
            size = Tokenizer.from_file(str(tokenizer)).get_vocab_size()
        except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse
            raise CheckpointError(f"{tokenizer} does not load as a tokenizer ({exc}); download it again, or remove it "
                                  "to convert a model that takes token ids only.") from None
        if size > vocab_size:
            raise CheckpointError(f"{tokenizer} has {size} tokens but config.json's vocab_size is {vocab_size}: ids "
                                  f">= {vocab_size} would have no embedding. The tokenizer is of another model.")
    if config.is_file():
        try:
            document = json.loads(config.read_bytes())
        except (OSError, ValueError, RecursionError) as exc:
            raise CheckpointError(f"{config} cannot be read as JSON ({exc}); download it again.") from None
        if not isinstance(document, dict):
            raise CheckpointError(f"{config} is a JSON {type(document).__name__}; it must be an object.")


@contextlib.contextmanager
def _open_shard(path: Path, framework: str):
    """safe_open, with a truncated, corrupt or unreadable shard turned into a CheckpointError."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework=framework) as f:
            yield f
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(
            f"{path} cannot be read as safetensors ({exc}): it is cut short (an interrupted download?) or "
            "corrupt. Download it again.") from exc
