"""Slow, readable torch reference of the Qwen3.5 MTP draft head and of the target's hidden states.

The semantics are those of vLLM's `Qwen3_5MultiTokenPredictor` (qwen3_5_mtp.py). For one MTP
position p it consumes the *next* token x[p+1] and the target's final-normed hidden state h[p]:

    e   = pre_fc_norm_embedding(embed(x[p+1]))     [H]    offset RMSNorm, x̂·(1+w)
    h   = pre_fc_norm_hidden(h[p])                 [H]
    z   = fc(concat(e, h))                         [H]    mtp.fc.weight [H, 2H], embedding half first
    z   = layers.0(z, rope(p), causal)             [H]    HF's own Qwen3_5DecoderLayer (full_attention):
                                                          q_proj rows interleave [query | gate] per head,
                                                          out = o_proj(attn · sigmoid(gate))
    out = norm(z)                                  [H]    the MTP's "hidden" (normed), fed back for draft 2+
    logits = lm_head(out)                          [V]    lm_head shared with the target (= embed when tied)

Drafts (`reference_drafts`). Committed tokens x[0..T]; the target has processed x[0..T-1] and
produced final-normed hiddens h[0..T-1] (x[T] is its last argmax / the bonus token):

    MTP position p = 0..T-1 : token x[p+1], hidden h[p]          (target hiddens)
    d1 = argmax MTP logits at position T-1                      (predicts x[T+1])
    MTP position T+j-1      : token d[j], hidden out[T+j-2]       (the MTP's own normed output)
    d[j+1] = argmax at that position, attending to the MTP keys/values of every earlier position.

Every forward here is a full causal forward over the whole sequence with no cache, so it is slow
and obviously equal to what an incremental (KV-cached) implementation must produce. All math is
fp32 whatever the checkpoint dtype (weights are upcast). Ties in argmax go to the lowest id.

HF fact this relies on (transformers 5.24): `Qwen3_5ForCausalLM(..., output_hidden_states=True)`
returns num_hidden_layers + 1 hidden states; [0] is the embedding output and [-1] is replaced by
`last_hidden_state`, i.e. the output of the final `model.norm` (normed). The pre-norm output of
the last decoder layer is not returned. `lm_head(hidden_states[-1]) == logits` bitwise.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5DecoderLayer,
    Qwen3_5RMSNorm,
    Qwen3_5TextRotaryEmbedding,
)

NESTED_PREFIX = "model.language_model."  # multimodal layout (model_type qwen3_5)
FLAT_PREFIX = "model."  # text-only layout (model_type qwen3_5_text)
MTP_PREFIX = "mtp."
MTP_LAYER_PREFIX = "mtp.layers.0."


# ---------------------------------------------------------------------------------------------
# checkpoint reading (independent of tools/make_tiny_checkpoint.py on purpose)


def load_text_config(ckpt_dir) -> Qwen3_5TextConfig:
    """The text config of a flat (qwen3_5_text) or nested (qwen3_5 + text_config) config.json.

    In the nested layout the top-level `tie_word_embeddings` wins (that is what HF ties on).
    The returned config uses eager attention so the reference is deterministic and simple.
    """
    raw = json.loads((Path(ckpt_dir) / "config.json").read_text())
    text = dict(raw.get("text_config", raw))
    if "text_config" in raw and "tie_word_embeddings" in raw:
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    if text.get("model_type", "qwen3_5_text") != "qwen3_5_text":
        raise ValueError(f"{ckpt_dir}: model_type {text.get('model_type')!r}, expected qwen3_5_text")
    config = Qwen3_5TextConfig.from_dict(text)
    config._attn_implementation = "eager"
    return config


def load_tensors(ckpt_dir) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors or of the shards listed in model.safetensors.index.json."""
    ckpt_dir = Path(ckpt_dir)
    index = ckpt_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (ckpt_dir / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{ckpt_dir}: no model.safetensors or model.safetensors.index.json")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(ckpt_dir / name)))
    return tensors


def text_prefix(tensors: dict[str, torch.Tensor]) -> str:
    """`model.language_model.` for nested checkpoints, else `model.`."""
    return NESTED_PREFIX if any(k.startswith(NESTED_PREFIX) for k in tensors) else FLAT_PREFIX


def lm_head_weight(tensors: dict[str, torch.Tensor], config: Qwen3_5TextConfig) -> torch.Tensor:
    """lm_head.weight [V, H]; the embedding when tied (HF does not save a tied lm_head)."""
    if config.tie_word_embeddings:
        return tensors[text_prefix(tensors) + "embed_tokens.weight"]
    if "lm_head.weight" not in tensors:
        raise KeyError("lm_head.weight missing and tie_word_embeddings is false in config.json")
    return tensors["lm_head.weight"]


def _cache_key(ckpt_dir) -> tuple:
    """Path plus file stamps, so a checkpoint rewritten in place is reloaded."""
    ckpt_dir = Path(ckpt_dir).resolve()
    stamps = tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(ckpt_dir.iterdir()))
    return str(ckpt_dir), stamps


# ---------------------------------------------------------------------------------------------
# target


@functools.lru_cache(maxsize=4)
def _target_model(key: tuple) -> Qwen3_5ForCausalLM:
    ckpt_dir = key[0]
    config = load_text_config(ckpt_dir)
    tensors = load_tensors(ckpt_dir)
    prefix = text_prefix(tensors)
    state = {FLAT_PREFIX + k[len(prefix) :]: v.float() for k, v in tensors.items() if k.startswith(prefix)}
    state["lm_head.weight"] = lm_head_weight(tensors, config).float()
    with torch.device("cpu"):
        model = Qwen3_5ForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise KeyError(f"{ckpt_dir}: missing {missing}, unexpected {unexpected}")
    return model


def target_model(ckpt_dir) -> Qwen3_5ForCausalLM:
    """HF Qwen3_5ForCausalLM (fp32, eager) with the checkpoint's weights; flat or nested, any shards."""
    return _target_model(_cache_key(ckpt_dir))


@torch.no_grad()
def target_hidden_states(ckpt_dir, token_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """Target forward over token_ids [T] → (final-normed hidden [T, H], logits [T, V]), fp32."""
    model = target_model(ckpt_dir)
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(1, -1)  # [1, T]
    out = model(ids, output_hidden_states=True, use_cache=False)
    return out.hidden_states[-1][0], out.logits[0]  # [T, H] (after model.norm), [T, V]


# ---------------------------------------------------------------------------------------------
# MTP head


class MTPReference:
    """The MTP head of a checkpoint, built from HF modules and the raw `mtp.*` tensors."""

    def __init__(self, ckpt_dir):
        config = load_text_config(ckpt_dir)
        num_layers = getattr(config, "mtp_num_hidden_layers", 1)
        if num_layers != 1:
            raise NotImplementedError(f"mtp_num_hidden_layers={num_layers}: the reference handles exactly 1")
        tensors = load_tensors(ckpt_dir)
        if not any(k.startswith(MTP_PREFIX) for k in tensors):
            raise KeyError(f"{ckpt_dir} has no mtp.* tensors (made with --no-mtp?)")
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.config = config
        self.embed = tensors[text_prefix(tensors) + "embed_tokens.weight"].float()  # [V, H]
        self.lm_head = lm_head_weight(tensors, config).float()  # [V, H]
        self.fc = _linear(tensors["mtp.fc.weight"])  # [H, 2H]
        self.pre_fc_norm_embedding = _rms_norm(tensors["mtp.pre_fc_norm_embedding.weight"], eps)
        self.pre_fc_norm_hidden = _rms_norm(tensors["mtp.pre_fc_norm_hidden.weight"], eps)
        self.norm = _rms_norm(tensors["mtp.norm.weight"], eps)
        layer_config = copy.deepcopy(config)
        layer_config.layer_types = ["full_attention"]
        layer_config.num_hidden_layers = 1
        self.layer = Qwen3_5DecoderLayer(layer_config, layer_idx=0).eval()
        layer_state = {
            k[len(MTP_LAYER_PREFIX) :]: v.float() for k, v in tensors.items() if k.startswith(MTP_LAYER_PREFIX)
        }
        self.layer.load_state_dict(layer_state, strict=True)  # names/shapes exactly a target full-attention layer
        self.rotary = Qwen3_5TextRotaryEmbedding(layer_config)
        known = {f"mtp.{n}.weight" for n in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
        known |= {MTP_LAYER_PREFIX + n for n in layer_state}
        extra = {k for k in tensors if k.startswith(MTP_PREFIX) and k not in known}
        if extra:
            raise KeyError(f"unexpected MTP tensors {sorted(extra)}")
        if self.fc.weight.shape != (hidden, 2 * hidden):
            raise ValueError(f"mtp.fc.weight {tuple(self.fc.weight.shape)}, expected {(hidden, 2 * hidden)}")

    @torch.no_grad()
    def forward(self, input_ids, hidden_states, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal forward over T MTP positions, no cache.

        input_ids [T] long: the token *after* each target position (x[p+1]).
        hidden_states [T, H]: target final-normed hiddens h[p] (or the MTP's own output for drafts).
        positions [T] long: rope positions p; row i attends to rows 0..i.
        → logits [T, V], hidden_out [T, H] (after mtp.norm), fp32.
        """
        input_ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)  # [T]
        positions = torch.as_tensor(positions, dtype=torch.long).reshape(1, -1)  # [1, T]
        num_tokens = input_ids.shape[0]
        e = self.pre_fc_norm_embedding(self.embed[input_ids])  # [T, H]
        h = self.pre_fc_norm_hidden(torch.as_tensor(hidden_states).float().reshape(num_tokens, -1))  # [T, H]
        x = self.fc(torch.cat([e, h], dim=-1)).unsqueeze(0)  # [1, T, H]
        cos_sin = self.rotary(x, positions)  # 2 × [1, T, rotary_dim]
        x = self.layer(x, position_embeddings=cos_sin, attention_mask=causal_mask(num_tokens), position_ids=positions)
        hidden_out = self.norm(x[0])  # [T, H]
        return hidden_out @ self.lm_head.T, hidden_out  # [T, V], [T, H]

    __call__ = forward


def causal_mask(num_tokens: int) -> torch.Tensor:
    """Additive mask [1, 1, T, T] for HF eager attention: 0 on/below the diagonal, min-float above."""
    blocked = torch.ones(num_tokens, num_tokens, dtype=torch.bool).triu(1)
    return torch.zeros(num_tokens, num_tokens).masked_fill(blocked, torch.finfo(torch.float32).min)[None, None]


def _linear(weight: torch.Tensor) -> nn.Linear:
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=False)
    linear.weight.data.copy_(weight.float())
    return linear


def _rms_norm(weight: torch.Tensor, eps: float) -> Qwen3_5RMSNorm:
    norm = Qwen3_5RMSNorm(weight.shape[0], eps=eps)  # offset: x̂ · (1 + w)
    norm.weight.data.copy_(weight.float())
    return norm


@functools.lru_cache(maxsize=4)
def _mtp_reference(key: tuple) -> MTPReference:
    return MTPReference(key[0])


def mtp_reference(ckpt_dir) -> MTPReference:
    """A cached MTPReference (reloaded if the checkpoint files change)."""
    return _mtp_reference(_cache_key(ckpt_dir))


# ---------------------------------------------------------------------------------------------
# drafts


@torch.no_grad()
def reference_drafts(ckpt_dir, token_ids, k: int, *, return_logits: bool = False):
    """The k recursive greedy MTP drafts after committed tokens x[0..T] (len(token_ids) = T+1 ≥ 2).

    → drafts LongTensor [k]; with return_logits also the draft logits [k, V] (row j chose draft j+1).
    """
    tokens = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)  # [T+1]
    if tokens.numel() < 2 or k < 1:
        raise ValueError(f"need at least 2 committed tokens and k >= 1 (got {tokens.numel()} tokens, k={k})")
    target_hidden, _ = target_hidden_states(ckpt_dir, tokens[:-1])  # h[0..T-1]: [T, H]
    mtp = mtp_reference(ckpt_dir)
    ids, hiddens = tokens[1:], target_hidden  # MTP position p pairs x[p+1] with h[p]
    drafts, draft_logits = [], []
    for _ in range(k):
        logits, out = mtp.forward(ids, hiddens, torch.arange(ids.numel()))  # [n, V], [n, H]
        draft = logits[-1].argmax()
        drafts.append(draft)
        draft_logits.append(logits[-1])
        ids = torch.cat([ids, draft.reshape(1)])  # next position consumes the draft ...
        hiddens = torch.cat([hiddens, out[-1:]])  # ... and the MTP's own normed output
    drafts = torch.stack(drafts)  # [k]
    return (drafts, torch.stack(draft_logits)) if return_logits else drafts
