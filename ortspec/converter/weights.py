"""Turns checkpoint tensors into the weight store the graphs use.

Everything a graph needs in a different form than HF stores it is prepared here, once,
in float32 with torch so it matches transformers' own arithmetic bit for bit:
linear weights transposed to [in, out]; offset RMSNorm weights as (1 + w); the GDN decay
scale as -exp(A_log); RoPE cos/sin tables as HF computes them; fused projections
concatenated column-wise (a column concat leaves every output element's dot product as it was).

Store names (i = layer index, "mtp.L0" for the MTP layer):
  embed [V,H]  lm_head [H,V]  final_norm [H]  rope.cos/rope.sin [L, rotary_dim/2]
  {p}.in_norm, {p}.post_norm [H]            (1 + w)
  {p}.qkv [H, 2*nh*hd + 2*kvh*hd]  columns: all query heads | all output-gate heads | k | v
  {p}.o [nh*hd, H] (o_proj / CONTEXT_ALPHA)  {p}.q_norm, {p}.k_norm [hd]  (1 + w)
  {p}.in_proj [H, C + vd + 2*nv]  columns: qkv | z | b | a     {p}.conv [C, 1, K]  {p}.conv_taps [K, C]
  {p}.dt_bias, {p}.decay_scale [nv]  {p}.gdn_norm [dv] (plain w)  {p}.out [vd, H]
  {p}.gate_up [H, 2*I]  {p}.down [I, H]
  mtp.fc [2H, H]  mtp.pre_embed, mtp.pre_hidden, mtp.norm [H]  (1 + w)
  draft_tokens int64 [N], mtp.draft_head [H, N]      with a draft vocabulary (converter/draft_vocab.py)
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ..errors import WeightError
from ..model_spec import FULL, LINEAR, ModelSpec
from .builder import WeightStore
from .checkpoint import CheckpointReader
from .layers import CONTEXT_ALPHA

_MATRIX_SUFFIXES = (".qkv", ".o", ".in_proj", ".out", ".gate_up", ".down")
_MATRICES = ("embed", "lm_head", "mtp.fc", "mtp.draft_head")
_STREAM_NORM_SUFFIXES = (".in_norm", ".post_norm")  # the norms on the residual stream (not q/k/gdn norms)
_STREAM_NORMS = ("final_norm", "mtp.pre_embed", "mtp.pre_hidden", "mtp.norm")


def _offset_norm(w: np.ndarray) -> np.ndarray:
    return (np.float32(1.0) + w.astype(np.float32)).astype(np.float32)


def rope_tables(spec: ModelSpec, max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_length, rotary_dim/2], computed exactly as transformers does (float32 torch)."""
    import torch

    dim = spec.rotary_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    positions = torch.arange(max_length, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    return freqs.cos().numpy(), freqs.sin().numpy()


class WeightPreparer:
    def __init__(self, spec: ModelSpec, reader: CheckpointReader, store: WeightStore):
        self.spec, self.reader, self.store = spec, reader, store

    def linear(self, name: str, out_features: int, in_features: int) -> np.ndarray:
        return self.reader.get(name, (out_features, in_features)).T  # [in, out]

    def prepare_all(self, max_length: int, with_mtp: bool) -> None:
        s = self.spec
        embed = self.reader.get("embed_tokens.weight", (s.vocab_size, s.hidden_size))
        self.store.add("embed", embed)
        if s.tie_word_embeddings:
            lm_head = embed
        elif not self.reader.has("lm_head.weight"):  # used to fall back to the embedding: another model
            raise WeightError(f"{self.reader.dir / 'config.json'} has tie_word_embeddings=false but the checkpoint "
                              "has no 'lm_head.weight': the output layer is missing. Download every shard; only if "
                              "the model shares its embedding as its output layer, set tie_word_embeddings to true.")
        else:
            lm_head = self.reader.get("lm_head.weight", (s.vocab_size, s.hidden_size))
        self.store.add("lm_head", lm_head.T)
        self.store.add("final_norm", _offset_norm(self.reader.get("norm.weight", (s.hidden_size,))))
        cos, sin = rope_tables(s, max_length)
        self.store.add("rope.cos", cos)
        self.store.add("rope.sin", sin)
        for i, kind in enumerate(s.layer_types):
            self.decoder_layer(f"layers.{i}", f"L{i}", kind)
        if with_mtp:
            self.mtp()

    def decoder_layer(self, src: str, dst: str, kind: str) -> None:
        s = self.spec
        H = s.hidden_size
        self.store.add(f"{dst}.in_norm", _offset_norm(self.reader.get(f"{src}.input_layernorm.weight", (H,))))
        self.store.add(f"{dst}.post_norm", _offset_norm(self.reader.get(f"{src}.post_attention_layernorm.weight", (H,))))
        if kind == FULL:
            self.attention(f"{src}.self_attn", dst)
        elif kind == LINEAR:
            self.gated_deltanet(f"{src}.linear_attn", dst)
        self.mlp(f"{src}.mlp", dst)

    def attention(self, src: str, dst: str) -> None:
        s = self.spec
        H, nh, kvh, hd = s.hidden_size, s.num_attention_heads, s.num_key_value_heads, s.head_dim
        # HF's q_proj rows are [q_h0, gate_h0, q_h1, gate_h1, ...] (each hd wide); regroup the
        # columns of the transposed weight to [all q | all gate], then k and v: one MatMul and
        # one Split give all four.
        q_proj = self.linear(f"{src}.q_proj.weight", 2 * nh * hd, H).reshape(H, nh, 2, hd)
        qkv = [q_proj[:, :, 0].reshape(H, nh * hd), q_proj[:, :, 1].reshape(H, nh * hd),
               self.linear(f"{src}.k_proj.weight", kvh * hd, H), self.linear(f"{src}.v_proj.weight", kvh * hd, H)]
        self.store.add(f"{dst}.qkv", np.concatenate(qkv, axis=1))
        # the context product runs with alpha = CONTEXT_ALPHA (layers.make_attention): halving
        # o_proj by a power of two cancels it exactly
        self.store.add(f"{dst}.o", self.linear(f"{src}.o_proj.weight", H, nh * hd) / np.float32(CONTEXT_ALPHA))
        self.store.add(f"{dst}.q_norm", _offset_norm(self.reader.get(f"{src}.q_norm.weight", (hd,))))
        self.store.add(f"{dst}.k_norm", _offset_norm(self.reader.get(f"{src}.k_norm.weight", (hd,))))

    def gated_deltanet(self, src: str, dst: str) -> None:
        import torch

        s = self.spec
        H, nv, dv, C, K = s.hidden_size, s.linear_num_value_heads, s.linear_value_head_dim, s.conv_dim, s.linear_conv_kernel_dim
        vd = s.linear_value_dim
        in_proj = np.concatenate(
            [
                self.linear(f"{src}.in_proj_qkv.weight", C, H),
                self.linear(f"{src}.in_proj_z.weight", vd, H),
                self.linear(f"{src}.in_proj_b.weight", nv, H),
                self.linear(f"{src}.in_proj_a.weight", nv, H),
            ],
            axis=1,
        )
        self.store.add(f"{dst}.in_proj", in_proj)
        conv = self.store.add(f"{dst}.conv", self.reader.get(f"{src}.conv1d.weight", (C, 1, K)))
        self.store.add(f"{dst}.conv_taps", self.store.arrays[conv][:, 0].T)  # [K, C]: gdn_cpu.py
        self.store.add(f"{dst}.dt_bias", self.reader.get(f"{src}.dt_bias", (nv,)))
        a_log = self.reader.get(f"{src}.A_log", (nv,))
        self.store.add(f"{dst}.decay_scale", (-torch.from_numpy(a_log).float().exp()).numpy())
        self.store.add(f"{dst}.gdn_norm", self.reader.get(f"{src}.norm.weight", (dv,)))
        self.store.add(f"{dst}.out", self.linear(f"{src}.out_proj.weight", H, vd))

    def mlp(self, src: str, dst: str) -> None:
        H, inter = self.spec.hidden_size, self.spec.intermediate_size
        gate = self.linear(f"{src}.gate_proj.weight", inter, H)
        up = self.linear(f"{src}.up_proj.weight", inter, H)
        self.store.add(f"{dst}.gate_up", np.concatenate([gate, up], axis=1))
        self.store.add(f"{dst}.down", self.linear(f"{src}.down_proj.weight", H, inter))

    def mtp(self) -> None:
        H = self.spec.hidden_size
        self.store.add("mtp.fc", self.linear("mtp.fc.weight", H, 2 * H))
        self.store.add("mtp.pre_embed", _offset_norm(self.reader.get("mtp.pre_fc_norm_embedding.weight", (H,))))
        self.store.add("mtp.pre_hidden", _offset_norm(self.reader.get("mtp.pre_fc_norm_hidden.weight", (H,))))
        self.store.add("mtp.norm", _offset_norm(self.reader.get("mtp.norm.weight", (H,))))
        self.decoder_layer("mtp.layers.0", "mtp.L0", FULL)


def cast_matrices(store: WeightStore, dtype: str, activations: str = "float32") -> None:
    """float16/bfloat16: the matrices (projections, MLP, embedding, lm_head) are stored and
    multiplied in that dtype; GDN parameters, RoPE tables and the q/k/GDN-output norms stay
    float32. activations (the dtype between layers, "float32" or ``dtype``): with ``dtype`` the
    norms on the residual stream are stored in it too, (1+w) rounded once, as ONNX Runtime's
    (Skip)SimplifiedLayerNormalization kernels take the weight in the input's dtype."""
    if activations not in ("float32", dtype):
        raise ValueError(f"activations {activations!r}: use 'float32' or the weights' dtype {dtype!r}")
    store.activations = _numpy_dtype(activations)
    if dtype == "float32":
        return
    for name, arr in store.arrays.items():
        matrix = (name in _MATRICES or name.endswith(_MATRIX_SUFFIXES)) and name not in store.quantized
        stream_norm = activations == dtype and (name in _STREAM_NORMS or name.endswith(_STREAM_NORM_SUFFIXES))
        if matrix or stream_norm:
            store.arrays[name] = round_to(arr, dtype)


def round_to(arr: np.ndarray, dtype: str) -> np.ndarray:
    """arr rounded to float16/bfloat16 (to nearest even, by torch: transformers' own rounding)."""
    import torch

    low = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    rounded = torch.from_numpy(np.ascontiguousarray(arr)).to(low)
    return rounded.view(torch.int16).numpy().view(np.uint16).view(_numpy_dtype(dtype))


def _numpy_dtype(dtype: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
