"""The dimensions of a Qwen3.5-text hybrid model, read from a HuggingFace config.json.

One frozen dataclass travels from the converter into manifest.json and from there into
the runtime, so both sides agree on every dimension without re-reading the checkpoint.
config.json is checked field by field: an object, each dimension an integer in range, each
float finite, each flag a bool; a wrong one is a CheckpointError naming the key, its value
and the type it must have (hidden_size "128" used to fail as "implies [1024, '128']").
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from .errors import CheckpointError, CheckpointNotFoundError, UnsupportedModelError

LINEAR = "linear_attention"
FULL = "full_attention"
MAX_DIMENSION = 2**31 - 1  # above any real model's; keeps products of dimensions far inside int64
_REQUIRED = object()

_SUPPORTED = ("qwen3_5_text", "qwen3_5")
_KNOWN_UNSUPPORTED = {
    "qwen3_next": "Qwen3-Next uses a mixture-of-experts MLP, which ortspec does not convert yet",
    "qwen3_5_moe": "Qwen3.5-MoE uses a mixture-of-experts MLP, which ortspec does not convert yet",
    "qwen3_5_moe_text": "Qwen3.5-MoE uses a mixture-of-experts MLP, which ortspec does not convert yet",
}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    tie_word_embeddings: bool
    mtp_num_hidden_layers: int
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int | None = None  # the longest sequence the model was made for, if config.json says

    # -- derived dimensions -------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:  # q and k width of a GDN layer
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:  # channels of the depthwise conv: q, k and v concatenated
        return 2 * self.linear_key_dim + self.linear_value_dim

    def layers_of(self, kind: str) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == kind]

    # -- (de)serialisation --------------------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        d = dict(d)
        d["layer_types"] = tuple(d["layer_types"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path) -> "ModelSpec":
        return cls.from_hf_config(read_hf_config(checkpoint_dir))

    @classmethod
    def from_hf_config(cls, config: dict) -> "ModelSpec":
        if not isinstance(config, dict):
            raise CheckpointError(f"config.json is a JSON {type(config).__name__}; it must be an object of the "
                                  "model's settings (hidden_size, num_hidden_layers, ...).")
        model_type = config.get("model_type")
        if isinstance(model_type, str) and model_type in _KNOWN_UNSUPPORTED:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported: {_KNOWN_UNSUPPORTED[model_type]}. "
                f"ortspec converts dense Qwen3.5 text models (model_type {' or '.join(map(repr, _SUPPORTED))})."
            )
        if model_type not in _SUPPORTED:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported. ortspec converts hybrid Gated-DeltaNet "
                f"models of type {' or '.join(map(repr, _SUPPORTED))}; check that this is a Qwen3.5 checkpoint."
            )
        text = config
        if model_type == "qwen3_5":
            if "text_config" not in config:
                raise UnsupportedModelError(
                    "model_type 'qwen3_5' needs a 'text_config' section in config.json; none was found."
                )
            if not isinstance(config["text_config"], dict):
                raise CheckpointError(f"config.json has text_config={_shown(config['text_config'])}; it must be an "
                                      "object.")
            text = dict(config["text_config"])
            text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
            text.setdefault("eos_token_id", config.get("eos_token_id"))
        if text.get("num_experts") or text.get("num_local_experts"):
            raise UnsupportedModelError(
                "this checkpoint has a mixture-of-experts MLP (num_experts in config.json); "
                "ortspec converts dense-MLP Qwen3.5 models only."
            )
        return cls._from_text_config(text)

    @classmethod
    def _from_text_config(cls, t: dict) -> "ModelSpec":
        if t.get("attention_bias"):
            raise UnsupportedModelError(
                "attention_bias=true (q/k/v/o projections with biases) is not supported; Qwen3.5 models have none."
            )
        if t.get("hidden_act", "silu") not in ("silu", "swish"):
            raise UnsupportedModelError(f"hidden_act={t.get('hidden_act')!r} is not supported; the MLP must use SiLU.")
        num_layers = _integer(t, "num_hidden_layers")
        layer_types = _layer_types(t, num_layers)
        rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise CheckpointError(f"config.json has rope_parameters={_shown(rope)}; it must be an object.")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported; only 'default' RoPE is.")
        rope_theta = _real(rope, "rope_theta", _real(t, "rope_theta", 10000.0))
        partial = _real(rope, "partial_rotary_factor", _real(t, "partial_rotary_factor", 0.25, maximum=1.0),
                        maximum=1.0)
        hidden, heads = _integer(t, "hidden_size"), _integer(t, "num_attention_heads")
        head_dim = _integer(t, "head_dim", hidden // heads)
        spec = cls(
            hidden_size=hidden,
            intermediate_size=_integer(t, "intermediate_size"),
            vocab_size=_integer(t, "vocab_size"),
            layer_types=layer_types,
            num_attention_heads=heads,
            num_key_value_heads=_integer(t, "num_key_value_heads"),
            head_dim=head_dim,
            linear_num_key_heads=_integer(t, "linear_num_key_heads"),
            linear_num_value_heads=_integer(t, "linear_num_value_heads"),
            linear_key_head_dim=_integer(t, "linear_key_head_dim"),
            linear_value_head_dim=_integer(t, "linear_value_head_dim"),
            linear_conv_kernel_dim=_integer(t, "linear_conv_kernel_dim", 4),
            rms_norm_eps=_real(t, "rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            partial_rotary_factor=partial,
            tie_word_embeddings=_flag(t, "tie_word_embeddings", False),
            mtp_num_hidden_layers=_integer(t, "mtp_num_hidden_layers", 0, minimum=0),
            eos_token_ids=_eos_ids(t.get("eos_token_id")),
            max_position_embeddings=t.get("max_position_embeddings"),
        )
        spec._check()
        return spec

    def _check(self) -> None:
        limit = self.max_position_embeddings
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise CheckpointError(f"config.json has max_position_embeddings={limit!r}; it must be a positive integer.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}."
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise CheckpointError(
                f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}."
            )
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise CheckpointError(
                f"head_dim={self.head_dim} with partial_rotary_factor={self.partial_rotary_factor} "
                f"gives rotary_dim={self.rotary_dim}; it must be even and at most head_dim."
            )


def _shown(value, limit: int = 40) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _kind(value) -> str:
    return {str: "a string", bool: "a bool", list: "a list", dict: "an object", type(None): "null",
            float: "a float", int: "an integer"}.get(type(value), type(value).__name__)


def _integer(t: dict, key: str, default=_REQUIRED, minimum: int = 1) -> int:
    """t[key] as an int in [minimum, MAX_DIMENSION] (default when absent or null; required without one)."""
    value = t.get(key)
    if value is None:
        if default is _REQUIRED:
            raise CheckpointError(f"config.json lacks {key!r}, which a Qwen3.5 text config must have.")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(f"config.json has {key}={_shown(value)}, {_kind(value)}; it must be an integer"
                              f"{' (without quotes)' if isinstance(value, str) else ''}.")
    if not minimum <= value <= MAX_DIMENSION:
        raise CheckpointError(f"config.json has {key}={value}; it must be an integer in [{minimum}, {MAX_DIMENSION}].")
    return value


def _real(t: dict, key: str, default: float, maximum: float = math.inf) -> float:
    """t[key] as a finite float in (0, maximum] (default when absent or null)."""
    value = t.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckpointError(f"config.json has {key}={_shown(value)}, {_kind(value)}; it must be a number.")
    number = float(value) if abs(value) < 1e308 else math.inf
    if not (math.isfinite(number) and 0 < number <= maximum):
        bound = f"0 < {key} <= {maximum:g}" if math.isfinite(maximum) else f"{key} > 0"
        raise CheckpointError(f"config.json has {key}={_shown(value)}; it must be a finite number with {bound}.")
    return number


def _flag(t: dict, key: str, default: bool) -> bool:
    value = t.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CheckpointError(f"config.json has {key}={_shown(value)}, {_kind(value)}; it must be true or false.")
    return value


def _layer_types(t: dict, num_layers: int) -> tuple[str, ...]:
    layer_types = t.get("layer_types")
    if layer_types is None:
        interval = _integer(t, "full_attention_interval", 4)
        return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers))
    if not isinstance(layer_types, list) or not all(isinstance(kind, str) for kind in layer_types):
        raise CheckpointError(f"config.json has layer_types={_shown(layer_types)}; it must be a list of strings "
                              f"({LINEAR!r} or {FULL!r}), one per layer.")
    bad = sorted(set(layer_types) - {LINEAR, FULL})
    if bad:
        raise UnsupportedModelError(f"layer_types contains {bad}; ortspec supports only {LINEAR!r} and {FULL!r} layers.")
    if len(layer_types) != num_layers:
        raise CheckpointError(f"config.json has num_hidden_layers={num_layers} but {len(layer_types)} layer_types; "
                              "they must agree.")
    return tuple(layer_types)


def _eos_ids(eos) -> tuple[int, ...]:
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_DIMENSION for i in ids):
        raise CheckpointError(f"config.json has eos_token_id={_shown(eos)}; it must be a token id, a list of token "
                              "ids (integers >= 0) or null.")
    return tuple(ids)


def read_hf_config(checkpoint_dir: str | Path) -> dict:
    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise CheckpointNotFoundError(
            f"checkpoint directory {str(path)!r} does not exist; pass a HuggingFace model directory "
            "holding config.json and *.safetensors."
        )
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointNotFoundError(
            f"{str(path)!r} has no config.json; pass the directory of a HuggingFace checkpoint "
            "(the one holding config.json and the *.safetensors files)."
        )
    try:
        return json.loads(config_path.read_bytes())
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, nesting too deep
        raise CheckpointError(f"{config_path} is not valid JSON: {exc}") from None
