"""Re-lay an ortspec-style (flat ``Qwen3_5ForCausalLM``) checkpoint for onnxruntime-genai's builder.

The peer's builder takes Qwen3.5 only as ``Qwen3_5ForConditionalGeneration`` (the multimodal
wrapper published checkpoints ship), so the same weights are re-laid, bit for bit:

    config.json   {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                   "text_config": <our config, model_type qwen3_5_text,
                                   rope_parameters + mrope_section + mrope_interleaved>,
                   "vision_config": <the smallest vision tower; the builder ignores it>}
    *.safetensors  model.X -> model.language_model.X; mtp.* and lm_head.* unchanged. Only the
                   JSON header changes; the data bytes are streamed through untouched.

mrope_section: text positions are equal in all three sections, so any split of rotary_dim/2 into
three gives plain RoPE; the peer's runtime needs one ("position_ids ... got 3" without it).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

from ortspec.errors import CheckpointError

TEXT_PREFIX, NESTED_PREFIX = "model.", "model.language_model."
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "vocab.json", "merges.txt")


class RelayoutError(CheckpointError):
    """The checkpoint cannot be re-laid (not a Qwen3.5 text checkpoint, or unreadable weights)."""


def mrope_section(rotary_dim: int) -> list[int]:
    """Three ints summing to rotary_dim / 2, largest first: 16 -> [3, 3, 2], 64 -> [11, 11, 10]."""
    half = rotary_dim // 2
    if rotary_dim % 2 or half < 3:
        raise RelayoutError(f"rotary_dim {rotary_dim} cannot be split into three M-RoPE sections "
                            "(needs an even rotary_dim >= 6)")
    base, extra = divmod(half, 3)
    return [base + (i < extra) for i in range(3)]


def text_config_of(config: dict) -> dict:
    """The text config of a flat (qwen3_5_text) or nested (qwen3_5) config.json."""
    text = dict(config.get("text_config", config))
    if text.get("model_type") not in ("qwen3_5_text", None) or "layer_types" not in text:
        raise RelayoutError(f"config.json is not a Qwen3.5 text model (model_type {text.get('model_type')!r}); "
                            "the peer harness takes Qwen3_5ForCausalLM / Qwen3_5ForConditionalGeneration checkpoints")
    return text


def relaid_text_config(config: dict) -> dict:
    """Our text config with model_type qwen3_5_text and the M-RoPE keys in rope_parameters."""
    text = text_config_of(config)
    text.pop("architectures", None)
    text["model_type"] = "qwen3_5_text"
    rope = dict(text.get("rope_parameters") or {})
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", text.pop("rope_theta", 10000.0))
    factor = rope.setdefault("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    rope["mrope_section"] = mrope_section(int(head_dim * factor))
    rope["mrope_interleaved"] = True
    text["rope_parameters"] = rope
    return text


def small_vision_config(out_hidden_size: int) -> dict:
    """The smallest vision tower transformers builds; its weights are absent (never used for text)."""
    return {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
            "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
            "num_position_embeddings": 64, "out_hidden_size": out_hidden_size}


def relaid_config(config: dict) -> dict:
    """config.json of the re-laid checkpoint (see the module docstring)."""
    text = relaid_text_config(config)
    body = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
            "vision_config": small_vision_config(text["hidden_size"]),
            "tie_word_embeddings": bool(text.get("tie_word_embeddings", False))}
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if text.get(key) is not None:
            body[key] = text[key]
    return body


def nested_name(name: str) -> str:
    """model.X -> model.language_model.X (already nested names, mtp.*, lm_head.* unchanged)."""
    if name.startswith(TEXT_PREFIX) and not name.startswith(NESTED_PREFIX):
        return NESTED_PREFIX + name[len(TEXT_PREFIX):]
    return name


def relay_safetensors(src: Path, dst: Path) -> list[str]:
    """Copy one safetensors file with its tensors renamed by nested_name; returns the new names.
    The header is rewritten (padded with spaces to 8 bytes, as safetensors aligns it); the data
    section follows byte for byte, so offsets stay valid."""
    with open(src, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        try:
            header = json.loads(f.read(length))
        except ValueError as err:
            raise RelayoutError(f"{src}: not a safetensors file ({err})") from err
        renamed = {(k if k == "__metadata__" else nested_name(k)): v for k, v in header.items()}
        blob = json.dumps(renamed, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        with open(dst, "wb") as out:
            out.write(struct.pack("<Q", len(blob)) + blob)
            shutil.copyfileobj(f, out, length=1 << 24)
    return [k for k in renamed if k != "__metadata__"]


def relay_checkpoint(src, dst) -> Path:
    """Write the re-laid checkpoint of `src` into `dst` (created); returns dst."""
    src, dst = Path(src), Path(dst)
    config_path = src / "config.json"
    if not config_path.is_file():
        raise RelayoutError(f"{src} has no config.json: pass a HuggingFace checkpoint directory")
    config = relaid_config(json.loads(config_path.read_text()))
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise RelayoutError(f"{src} has no *.safetensors weights")
    dst.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for path in files:
        weight_map.update(dict.fromkeys(relay_safetensors(path, dst / path.name), path.name))
    if (src / "model.safetensors.index.json").exists():
        index = json.loads((src / "model.safetensors.index.json").read_text())
        index["weight_map"] = dict(sorted(weight_map.items()))
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in SIDE_FILES:
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)
    return dst
