"""The dimensions of a Qwen3.5-text hybrid model, read from a HuggingFace config.json.

One frozen dataclass travels from the converter into manifest.json and from there into
the runtime, so both sides agree on every dimension without re-reading the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .errors import CheckpointError, CheckpointNotFoundError, UnsupportedModelError

LINEAR = "linear_attention"
FULL = "full_attention"

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
        model_type = config.get("model_type")
        if model_type in _KNOWN_UNSUPPORTED:
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
        def need(key):
            if key not in t or t[key] is None:
                raise CheckpointError(f"config.json lacks {key!r}, which a Qwen3.5 text config must have.")
            return t[key]

        if t.get("attention_bias"):
            raise UnsupportedModelError(
                "attention_bias=true (q/k/v/o projections with biases) is not supported; Qwen3.5 models have none."
            )
        if t.get("hidden_act", "silu") not in ("silu", "swish"):
            raise UnsupportedModelError(f"hidden_act={t.get('hidden_act')!r} is not supported; the MLP must use SiLU.")
        num_layers = need("num_hidden_layers")
        layer_types = t.get("layer_types")
        if layer_types is None:
            interval = t.get("full_attention_interval", 4)
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]
        layer_types = tuple(layer_types)
        bad = sorted(set(layer_types) - {LINEAR, FULL})
        if bad:
            raise UnsupportedModelError(
                f"layer_types contains {bad}; ortspec supports only {LINEAR!r} and {FULL!r} layers."
            )
        if len(layer_types) != num_layers:
            raise CheckpointError(
                f"config.json has num_hidden_layers={num_layers} but {len(layer_types)} layer_types; "
                "they must agree."
            )
        rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported; only 'default' RoPE is.")
        rope_theta = rope.get("rope_theta", t.get("rope_theta", 10000.0))
        partial = rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25))
        head_dim = t.get("head_dim") or need("hidden_size") // need("num_attention_heads")
        eos = t.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        spec = cls(
            hidden_size=need("hidden_size"),
            intermediate_size=need("intermediate_size"),
            vocab_size=need("vocab_size"),
            layer_types=layer_types,
            num_attention_heads=need("num_attention_heads"),
            num_key_value_heads=need("num_key_value_heads"),
            head_dim=head_dim,
            linear_num_key_heads=need("linear_num_key_heads"),
            linear_num_value_heads=need("linear_num_value_heads"),
            linear_key_head_dim=need("linear_key_head_dim"),
            linear_value_head_dim=need("linear_value_head_dim"),
            linear_conv_kernel_dim=t.get("linear_conv_kernel_dim", 4),
            rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            partial_rotary_factor=float(partial),
            tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
            mtp_num_hidden_layers=int(t.get("mtp_num_hidden_layers", 0) or 0),
            eos_token_ids=eos_ids,
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
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_path} is not valid JSON: {exc}") from exc
