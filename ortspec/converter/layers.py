"""One ``make_*`` function per subgraph of a Qwen3.5 decoder layer.

Activations are [B, M, H] (B requests, M token rows each) in ``g.activations``: float32, or
with ``convert(activations="model")`` the model's float16/bfloat16, as transformers runs a
half-precision model (its RMSNorm computes in float32 inside and returns the input's dtype;
so do ONNX Runtime's norm kernels). Either way the mixers work in float32 inside, because
their states are float32: the attention casts its q/k/v/gate projection to float32 once
(fp32 KV cache, RoPE, softmax) and its gated context back once before o_proj; the GDN layer
casts in_proj's output once (conv, recurrence, gated norm over fp32 states) and the gated
norm's output back once before out_proj. The MLP runs in the matmul dtype throughout.

Every op here is row-wise or a product over rows that computes each row the same way
whatever rows share the call, so the M=1 decode and the M=k+1 verify compute the same bits
per token (the exactness tests depend on this; tools/row_invariance.py measures it op kind
by op kind on ONNX Runtime's CPU EP).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from onnx import TensorProto

from ..model_spec import ModelSpec
from .builder import CPU, GraphBuilder

F32 = TensorProto.FLOAT
CONTEXT_ALPHA = 2.0  # attention context product: any alpha != 1 keeps the CPU GEMM off its one-row kernel


@dataclasses.dataclass
class StepInputs:
    """Per-graph values every layer reads: positions and the attention bias."""

    positions: str  # int64 [B, M]: also the rows of the RoPE tables (make_rope)
    attn_bias: str | None  # float [B, 1, M*groups, W] (one row: [B, 1, 1, W]): 0 where slot <= position, -inf
    # elsewhere; None where the rows write their KV but none of them attends (make_kv_step)
    one_row: bool = False  # M is 1 in a portable graph: make_attention moves rows by Reshape (see there)
    shared_slots: dict | None = None  # a portable graph's KV scatter indices, made once for all its layers
    slots: str | None = None  # int64 [W]: the slot numbers the bias compares with (a later pass over W reuses them)

    def kv_slots(self, g: GraphBuilder, spec: ModelSpec, new_key: str, new_value: str) -> tuple[str, str]:
        """The scatter indices of make_attention's new KV rows new_key [B, kvh, hd, M] and new_value
        [B, kvh, M, hd]: the positions expanded to their shapes. Every attention layer of a graph (the
        MTP head's too: the same heads) writes at the same positions, so a portable graph expands them
        once (portable_kv_slots); a CPU graph per layer."""
        if self.shared_slots is None:
            return (g.op("Expand", [g.op("Unsqueeze", [self.positions, g.const([1, 2])]), g.op("Shape", [new_key])]),
                    g.op("Expand", [g.op("Unsqueeze", [self.positions, g.const([1, 3])]), g.op("Shape", [new_value])]))
        if not self.shared_slots:
            self.shared_slots.update(portable_kv_slots(g, spec, self.positions, self.one_row))
        return self.shared_slots["key"], self.shared_slots["value"]


def portable_kv_slots(g: GraphBuilder, spec: ModelSpec, positions: str, one_row: bool) -> dict[str, str]:
    """{"key": [B, kvh, hd, M], "value": [B, kvh, M, hd]}: positions [B, M] broadcast to the shapes
    of the new KV rows. Expand broadcasts its input against a constant target whose batch and row
    axes are 1, so no shape arithmetic builds the target. With one row both index tensors hold the
    same B*kvh*hd values in the same order, so the value's is a view of the key's: one Expand."""
    kvh, hd = spec.num_key_value_heads, spec.head_dim
    key = g.op("Expand", [g.op("Unsqueeze", [positions, g.const([1, 2])]), g.const([1, kvh, hd, 1])])
    if one_row:
        return {"key": key, "value": g.op("Reshape", [key, g.const([0, kvh, 1, hd])])}
    value = g.op("Expand", [g.op("Unsqueeze", [positions, g.const([1, 3])]), g.const([1, kvh, 1, hd])])
    return {"key": key, "value": value}


def _shared_slots(g: GraphBuilder, positions: str, one_row: bool) -> dict | None:
    """A portable graph's scatter indices for these positions, one dict per graph: the MTP head's
    catch-up inside verify_mtp_k{k} reads the target's (the same positions, the same heads)."""
    if g.target == CPU:
        return None
    return g.memo.setdefault(("kv_slots", positions, one_row), {})


def make_bias_slots(g: GraphBuilder, max_length: int, window: str | None) -> str:
    """int64 [W]: the slot numbers 0..W-1 of a key cache input [B, kvh, hd, W] (None: all max_length)."""
    if window is None:
        return g.const(range(max_length), hint="slots")  # [L]
    width = g.op("Squeeze", [g.op("Shape", [window], start=3, end=4)])  # W, a scalar
    return g.op("Range", [g.const(0), width, g.const(1)], hint="slots")  # [W]


def make_step_inputs(g: GraphBuilder, spec: ModelSpec, positions: str, max_length: int,
                     window: str | None = None, rows: int | None = None, slots: str | None = None) -> StepInputs:
    """window: a key cache input [B, kvh, hd, W] whose W slots the rows attend over. The runtime
    may pass the first W slots of the cache, any W past every position of the call: masked
    slots add exact zeros, so a row's bits do not depend on W (tools/row_invariance.py).
    None: all max_length slots. rows: M where it is static (None: any). A portable graph of one
    row keeps one bias row [B, 1, 1, W], which every query row of its heads broadcasts (the
    same values as the expanded rows, one kernel fewer). slots: make_bias_slots' value for this
    window where the graph has it already."""
    slots = slots or make_bias_slots(g, max_length, window)
    visible = g.op("LessOrEqual", [slots, g.op("Unsqueeze", [positions, g.const([2])])])  # [B, M, W]
    bias = g.op("Where", [visible, g.const(0.0, "float32"), g.const(float("-inf"), "float32")])
    one_row = rows == 1 and g.target != CPU
    shared = _shared_slots(g, positions, one_row)
    if one_row:
        return StepInputs(positions, g.op("Unsqueeze", [bias, g.const([1])], hint="attn_bias"), one_row=True,
                          shared_slots=shared, slots=slots)
    # one bias row per query row of make_attention (row m*groups + g attends like row m)
    groups = spec.num_attention_heads // spec.num_key_value_heads
    bias = g.op("Expand", [g.op("Unsqueeze", [bias, g.const([2])]), g.const([1, 1, groups, 1])])  # [B, M, groups, W]
    # Reshape's 0 keeps that axis (B, W): a constant target, no shape arithmetic
    return StepInputs(positions, g.op("Reshape", [bias, g.const([0, 1, -1, 0])], hint="attn_bias"),  # [B, 1, M*groups, W]
                      shared_slots=shared, slots=slots)


def make_kv_step(g: GraphBuilder, positions: str, max_length: int, window: str | None = None) -> StepInputs:
    """(portable graphs) The StepInputs of rows that write their KV rows but do not attend
    themselves (the MTP head's catch-up rows, of which one attends: make_one_row_steps): no bias."""
    return StepInputs(positions, None, shared_slots=_shared_slots(g, positions, False),
                      slots=make_bias_slots(g, max_length, window))


def make_one_row_steps(g: GraphBuilder, spec: ModelSpec, positions: str, passes: int, slots: str,
                       scatter_from: int = 0) -> list[StepInputs]:
    """(portable graphs) The StepInputs of ``passes`` one-row passes over one window, made together:
    positions int64 [B, passes], column j pass j's; slots make_bias_slots' [W]; the passes from
    ``scatter_from`` on write KV rows (the ones before only attend). One mask, one bias and one
    Expand of the scatter indices for all the passes, then a Split of each (one kernel each) where
    there are several; the values are those make_step_inputs gives each pass alone."""
    kvh, hd = spec.num_key_value_heads, spec.head_dim
    visible = g.op("LessOrEqual", [slots, g.op("Unsqueeze", [positions, g.const([2])])])  # [B, passes, W]
    bias = g.op("Where", [visible, g.const(0.0, "float32"), g.const(float("-inf"), "float32")])

    def apart(x: str, axis: int) -> list[str]:
        if passes == 1:
            return [x]
        return g.op("Split", [x, g.const([1] * passes)], num_outputs=passes, axis=axis)

    per_position = apart(positions, 1)  # [B, 1] each
    biases = apart(bias, 1)  # [B, 1, W] each
    shared = [None] * passes
    if passes > scatter_from:
        keys = g.op("Expand", [g.op("Unsqueeze", [positions, g.const([1, 2])]), g.const([1, kvh, hd, 1])])
        for j, key in enumerate(apart(keys, 3)[scatter_from:], scatter_from):  # [B, kvh, hd, 1] each
            shared[j] = {"key": key, "value": g.op("Reshape", [key, g.const([0, kvh, 1, hd])])}
    return [StepInputs(p, g.op("Unsqueeze", [b, g.const([1])], hint="attn_bias"), one_row=True, shared_slots=s,
                       slots=slots) for p, b, s in zip(per_position, biases, shared)]


def make_rms_norm(g: GraphBuilder, x: str, weight: str, eps: float) -> str:
    """Offset RMSNorm x̂·(1+w); the store already holds (1+w), in x's dtype (float32 inside)."""
    return g.op("SimplifiedLayerNormalization", [x, g.weight(weight)], axis=-1, epsilon=eps, stash_type=1)


def make_add_rms_norm(g: GraphBuilder, x: str, residual: str, weight: str, eps: float) -> tuple[str, str]:
    """(norm(x + residual), x + residual) in one fused op."""
    normed, _, _, total = g.ms(
        "SkipSimplifiedLayerNormalization", [x, residual, g.weight(weight)], num_outputs=4, epsilon=eps
    )
    return normed, total


def make_mlp(g: GraphBuilder, spec: ModelSpec, x: str, prefix: str) -> str:
    """down(silu(gate) * up), [B, M, H] in the activations' dtype in and out. The whole chain
    runs in the matmul dtype, as transformers runs it in that dtype (with fp16/bf16 weights and
    float32 activations, one Cast in and one out; with activations in the model dtype none):

        x ─ (Cast) ─ MatMul(gate_up) ─ Split ─ gate ─ ScaledSiLU(alpha 1) ─ Mul ─ MatMul(down) ─ (Cast)
                                             └─ up ─────────────────────────┘
    """
    low = g.matmul_dtype(f"{prefix}.gate_up")
    gate, up = g.op("Split", [g.linear(x, f"{prefix}.gate_up", out_dtype=low), g.const([spec.intermediate_size] * 2)],
                    num_outputs=2, axis=-1)  # [B, M, I] each, in low
    act = make_silu(g, gate, low)  # gate * sigmoid(gate)
    return g.linear(g.op("Mul", [act, up]), f"{prefix}.down", hint=f"{prefix}.mlp_out", x_dtype=low)


def make_silu(g: GraphBuilder, x: str, dtype: int = F32) -> str:
    """x * sigmoid(x) in one kernel. ScaledSiLU (alpha 1) rounds like transformers in fp16/bf16;
    on the CPU, in float32, QuickGelu (alpha 1: the same function) runs on MLAS's vectorized
    logistic and is several times faster (docs/history.md); its CPU kernel is float32 only."""
    if g.target == CPU and dtype == F32:
        return g.ms("QuickGelu", [x], alpha=1.0)
    return g.ms("ScaledSiLU", [x], alpha=1.0)


def make_gated_norm(g: GraphBuilder, spec: ModelSpec, core: str, z: str, weight: str) -> str:
    """The GDN output norm: RMSNorm per value head (plain weight) times silu(z). core and z
    [.., nv*dv] float32, the result too. One GatedRMSNorm, except on the CPU: there it costs
    several times the chain of RMSNorm per head, QuickGelu(z) and Mul (gdn_cpu's docstring)."""
    if g.target != CPU:
        return g.ms("GatedRMSNorm", [core, g.weight(weight), z], activation="silu", epsilon=spec.rms_norm_eps)
    heads = g.op("Reshape", [core, g.const([0, 0, spec.linear_num_value_heads, spec.linear_value_head_dim])])
    return make_gated_norm_chain(g, spec, heads, z, weight)


def make_gated_norm_chain(g: GraphBuilder, spec: ModelSpec, heads: str, z: str, weight: str) -> str:
    """make_gated_norm on the CPU, from the heads apart: heads [B, M, nv, dv], z [B, M, nv*dv]."""
    normed = g.op("SimplifiedLayerNormalization", [heads, g.weight(weight)], axis=-1, epsilon=spec.rms_norm_eps,
                  stash_type=1)  # [B, M, nv, dv]
    packed = g.op("Reshape", [normed, g.const([0, 0, spec.linear_value_dim])])
    return g.op("Mul", [packed, make_silu(g, z)])


def make_rope(g: GraphBuilder, spec: ModelSpec, x: str, heads: int, step: StepInputs) -> str:
    """Rotate-half RoPE on the first rotary_dim channels of each head, the rest passed through,
    in one kernel (com.microsoft RotaryEmbedding reads the cos/sin rows at the positions itself).
    x and the result are [B, M, heads, hd]; the op takes them packed [B, M, heads*hd]."""
    packed = g.op("Reshape", [x, g.const([0, 0, heads * spec.head_dim])])
    rotated = g.ms("RotaryEmbedding", [packed, step.positions, g.weight("rope.cos"), g.weight("rope.sin")],
                   num_heads=heads, rotary_embedding_dim=spec.rotary_dim, interleaved=0)
    return g.op("Reshape", [rotated, g.const([0, 0, heads, spec.head_dim])])


def make_attention(g: GraphBuilder, spec: ModelSpec, x: str, prefix: str, step: StepInputs,
                   past_key: str, past_value: str, merged: bool = False) -> tuple[str, ...]:
    """Gated GQA over a static cache, float32 inside (x and the output [B, M, H] in the
    activations' dtype: the projection is cast to float32 once, the gated context back once).
    Returns (output [B,M,H], new_key, new_value), and with
    merged=True also the merged key and value views (the cache with this call's rows in place,
    for a later pass in the same graph to attend over).

    Cache layout: key transposed [B, kvh, hd, W], value [B, kvh, W, hd] (W: the cache's L slots,
    or the window of the first W the runtime passes, see make_step_inputs). The graph scatters
    this call's rows into a merged view at their positions and attends over all W slots
    with a positional mask, so a token sees its keys in the same slots (same summation
    order) whether it arrives in a decode or a verify call. The runtime writes the new
    rows (new_key [B,kvh,hd,M], new_value [B,kvh,M,hd]) into the cache buffers in place.
    """
    q, gate, new_key, new_value, keys, values = make_attention_rows(g, spec, x, prefix, step, past_key, past_value)
    out = make_attention_context(g, spec, q, gate, keys, values, prefix, step)
    return (out, new_key, new_value, keys, values) if merged else (out, new_key, new_value)


def make_attention_rows(g: GraphBuilder, spec: ModelSpec, x: str, prefix: str, step: StepInputs,
                        past_key: str, past_value: str) -> tuple[str, ...]:
    """make_attention's first half, every row: the projection, the queries q [B, M, nh, hd] (normed
    and rotated), the gate [B, M, nh*hd], the new KV rows and the merged views they are scattered
    into. Returns (q, gate, new_key, new_value, keys, values)."""
    nh, kvh, hd, eps = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim, spec.rms_norm_eps
    q, gate, k, v = g.op("Split", [g.linear(x, f"{prefix}.qkv", out_dtype=F32),
                                   g.const([nh * hd, nh * hd, kvh * hd, kvh * hd])], num_outputs=4, axis=-1)
    q = g.op("Reshape", [q, g.const([0, 0, nh, hd])])
    q = make_rope(g, spec, make_rms_norm(g, q, f"{prefix}.q_norm", eps), nh, step)  # [B, M, nh, hd]
    k = g.op("Reshape", [k, g.const([0, 0, kvh, hd])])
    k = make_rope(g, spec, make_rms_norm(g, k, f"{prefix}.k_norm", eps), kvh, step)  # [B, M, kvh, hd]
    v = g.op("Reshape", [v, g.const([0, 0, kvh, hd])])

    rows = _RowMoves(g, step.one_row)
    new_key = rows.transpose(k, [0, 2, 3, 1], [0, kvh, hd, 1])  # [B, kvh, hd, M]
    new_value = rows.transpose(v, [0, 2, 1, 3], [0, kvh, 1, hd])  # [B, kvh, M, hd]
    key_slots, value_slots = step.kv_slots(g, spec, new_key, new_value)  # int64, the shapes of new_key, new_value
    keys = g.op("ScatterElements", [past_key, key_slots, new_key], axis=3)  # [B, kvh, hd, W]
    values = g.op("ScatterElements", [past_value, value_slots, new_value], axis=2)  # [B, kvh, W, hd]
    return q, gate, new_key, new_value, keys, values


def make_attention_context(g: GraphBuilder, spec: ModelSpec, q: str, gate: str, keys: str, values: str,
                           prefix: str, step: StepInputs) -> str:
    """make_attention's second half: the queries q [B, M, nh, hd] over the merged views, gated by
    gate [B, M, nh*hd], through o_proj: [B, M, H] in the activations' dtype. step gives the bias
    (its rows M, and one_row for a portable one-row call)."""
    nh, kvh, hd = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
    groups = nh // kvh
    rows = _RowMoves(g, step.one_row)
    # Query head h uses kv head h // groups: the queries of one kv head, all rows and groups,
    # are the rows of one product with the cache [B, kvh, M*groups, hd]. ONNX Runtime's CPU
    # GEMM computes a row the same way for any number of rows except through its one-row
    # kernel, which it takes only for alpha == 1 (tools/row_invariance.py): the scores carry
    # alpha = hd^-1/2 and the context alpha = 2 (the o_proj weight is stored halved; powers
    # of two cancel exactly), so a token's bits do not depend on the rows beside it.
    qg = rows.transpose(g.op("Reshape", [q, g.const([0, 0, kvh, groups, hd])]), [0, 2, 1, 3, 4],
                        [0, kvh, groups, hd])
    qg = g.op("Reshape", [qg, g.const([0, 0, -1, hd])])  # [B, kvh, M*groups, hd]
    scores = g.ms("FusedMatMul", [qg, keys], alpha=hd ** -0.5)  # [B, kvh, M*groups, W]
    probs = g.op("Softmax", [g.op("Add", [scores, step.attn_bias])], axis=-1)
    ctx = g.ms("FusedMatMul", [probs, values], alpha=CONTEXT_ALPHA)  # [B, kvh, M*groups, hd]
    ctx = rows.transpose(g.op("Reshape", [ctx, g.const([0, 0, -1, groups, hd])]), [0, 2, 1, 3, 4], [0, 1, nh * hd])
    ctx = g.op("Reshape", [ctx, g.const([0, 0, nh * hd])])  # [B, M, nh*hd], head h = kv head * groups + group
    gated = g.op("Mul", [ctx, g.op("Sigmoid", [gate])])
    return g.linear(gated, f"{prefix}.o", hint=f"{prefix}.attn_out", x_dtype=F32)  # [B, M, H] in the activations


class _RowMoves:
    """make_attention's Transposes between the row axis M and the head axes. Where M is 1 in a
    portable graph (a decode, a draft pass) each moves only axes of size 1, so the bytes keep their
    order: a Reshape to the same shape gives the same tensor, and on CUDA it is an alias where the
    Transpose was a copy kernel (four per attention layer). The CPU graphs keep their Transposes."""

    def __init__(self, g: GraphBuilder, one_row: bool) -> None:
        self.g, self.one_row = g, one_row

    def transpose(self, x: str, perm: list[int], one_row_shape: list[int]) -> str:
        if self.one_row:
            return self.g.op("Reshape", [x, self.g.const(one_row_shape)])
        return self.g.op("Transpose", [x], perm=perm)


L2NORM_EPS = 1e-6  # transformers' l2norm(x, eps=1e-6) on the GDN queries and keys


def l2_normalize(g: GraphBuilder, x: str, heads: int, head_dim: int, scale: float = 1.0,
                 shape: list[int] | None = None) -> str:
    """scale * x / sqrt(sum(x^2) + eps) per head, as transformers' l2norm (LinearAttention expects
    it), in one kernel: RMSNorm divides by sqrt(sum(x^2)/d + eps'), so with eps' = eps/d and the
    weight scale/sqrt(d) it is the same quotient (up to rounding). [B, M, heads*d] -> [B, M, heads, d]
    (or to ``shape``, a Reshape target whose last axis is the head's d)."""
    xh = g.op("Reshape", [x, g.const(shape or [0, 0, heads, head_dim])])
    weight = g.const([scale * head_dim ** -0.5] * head_dim, dtype=np.float32, hint="l2norm_weight")
    return g.op("SimplifiedLayerNormalization", [xh, weight], axis=-1, epsilon=L2NORM_EPS / head_dim, stash_type=1)


def make_gated_deltanet(g: GraphBuilder, spec: ModelSpec, x: str, prefix: str, conv_state: str,
                        recurrent_state: str, per_position: int = 0, verify: str = "per_row"):
    """Gated DeltaNet layer. Returns (output [B,M,H], conv, recurrent); x and the output
    in the activations' dtype, everything between in float32 (one Cast after in_proj, one
    before out_proj, where the activations are not float32).

    conv_state [B, K-1, C] (channels-last tail of the pre-conv q,k,v inputs) and
    recurrent_state [B, nv, dk, dv] (fp32). With per_position=0 conv and recurrent are the
    states after the last row. With per_position=M (a static row count) they are what a select
    commit needs, in the form ``verify`` (manifest.GDN_VERIFY_FORMS):
      per_row       windows, slot j = state after row j: conv [M, B, K-1, C], recurrent
                    [M, B, nv, dk, dv]. The CPU kernels refuse the ops' own ``state_window``, so
                    the windows are built by data movement (``_conv_window``) and by running
                    LinearAttention once per row (``_recurrence_per_row``). Every op runs on the
                    same rows with the same bits (M rows in one call equal M one-row calls:
                    tools/row_invariance.py).
      state_window  the same windows from one call of each op with its ``state_window`` = M
                    (CUDA only); conv_state and recurrent_state are then the ops' past windows
                    [M, B, ...], the live state in slot M-1, the only one they read (the runtime
                    lays it there: manifest.past_window_name)
      transition    dicts of the rows' transition record (manifest.TRANSITION_RECORD), each op run
                    once over all M rows: conv {"conv_inputs": pre-conv q,k,v [B, M, C]},
                    recurrent {"gdn_keys": k̂ [B, M, nk, dk], "gdn_values": v [B, M, nv*dv],
                    "gdn_decay": g, "gdn_beta": β [B, M, nv]}; the commit replays the accepted
                    rows onto the live states (runtime.states, native replay_transitions)

                 x ─ MatMul(in_proj) ─ Split ─┬─ qkv ─ CausalConvWithState(silu) ─ Split ─ q,k,v
                                              ├─ z ─────────────────────────────────────┐
                                              └─ b, a ─ LinearAttentionGate ─ decay,β   │
        q,k ─ l2norm (one RMSNorm each) ─ LinearAttention(gated_delta) ─ GatedRMSNorm(·, z) ─ MatMul(out)
                                           nk q/k heads, nv v heads
    """
    nk, nv, dk = spec.linear_num_key_heads, spec.linear_num_value_heads, spec.linear_key_head_dim
    kd, vd, C = spec.linear_key_dim, spec.linear_value_dim, spec.conv_dim
    window = per_position if verify == "state_window" else 0  # the ops' own state_window
    qkv, z, b, a = g.op("Split", [g.linear(x, f"{prefix}.in_proj", out_dtype=F32), g.const([C, vd, nv, nv])],
                        num_outputs=4, axis=-1)
    decay, beta = g.ms("LinearAttentionGate", [a, g.weight(f"{prefix}.dt_bias"), g.weight(f"{prefix}.decay_scale"), b],
                       num_outputs=2)  # [B, M, nv] each
    mixed, conv_out = g.ms("CausalConvWithState", [qkv, g.weight(f"{prefix}.conv"), "", conv_state], num_outputs=2,
                           activation="silu", channels_last=1, **_window_attribute(window))  # [B, M, C], [(M,) B, K-1, C]
    q, k, v = g.op("Split", [mixed, g.const([kd, kd, vd])], num_outputs=3, axis=-1)
    # nk query/key heads serve nv value heads, value head j reading key head j // (nv/nk) as
    # transformers' repeat_interleave does: LinearAttention maps heads so itself (kv_num_heads
    # a multiple of the key's heads, fewer query heads: "inverse GQA"), so no head is repeated
    q = g.op("Reshape", [l2_normalize(g, q, nk, dk), g.const([0, 0, kd])])  # [B, M, nk*dk]
    keys = l2_normalize(g, k, nk, dk)  # [B, M, nk, dk]
    k = g.op("Reshape", [keys, g.const([0, 0, kd])])

    def recurrence(state, q, k, v, decay, beta, window=0):
        return g.ms("LinearAttention", [q, k, v, state, decay, beta], num_outputs=2, q_num_heads=nk, kv_num_heads=nv,
                    update_rule="gated_delta", scale=float(dk ** -0.5), **_window_attribute(window))

    if per_position == 0 or verify != "per_row":
        core, recurrent_out = recurrence(recurrent_state, q, k, v, decay, beta, window)
    else:
        conv_out = _conv_window(g, conv_state, qkv, per_position, spec.linear_conv_kernel_dim)
        core, recurrent_out = _recurrence_per_row(g, recurrence, recurrent_state, [q, k, v, decay, beta],
                                                  per_position)
    if per_position and verify == "transition":  # the ops' states after the last row are left unused
        conv_out = {"conv_inputs": qkv}
        recurrent_out = {"gdn_keys": keys, "gdn_values": v, "gdn_decay": decay, "gdn_beta": beta}
    out = g.linear(make_gated_norm(g, spec, core, z, f"{prefix}.gdn_norm"), f"{prefix}.out", hint=f"{prefix}.gdn_out",
                   x_dtype=F32)
    return out, conv_out, recurrent_out


def _window_attribute(window: int) -> dict:
    """The ops' state_window attribute where a window is asked for; none otherwise (the graphs of
    the other forms stay what they were, loadable on the CPU)."""
    return {"state_window": window} if window else {}


def _conv_window(g: GraphBuilder, conv_state: str, qkv: str, rows: int, kernel: int) -> str:
    """The conv state after each row, [rows, B, K-1, C], by data movement alone: the state after
    row j is the last K-1 pre-conv inputs up to row j (what CausalConvWithState keeps, bit for
    bit), so the conv itself runs once over all rows."""
    tail = kernel - 1
    inputs = g.op("Concat", [conv_state, qkv], axis=1)  # [B, K-1+M, C]: the tail, then this call's rows
    index = g.const([[j + 1 + i for i in range(tail)] for j in range(rows)])  # [M, K-1]: rows j+1 .. j+K-1
    return g.op("Transpose", [g.op("Gather", [inputs, index], axis=1)], perm=[1, 0, 2, 3])  # [M, B, K-1, C]


def _recurrence_per_row(g: GraphBuilder, recurrence, state: str, inputs: list[str], rows: int) -> tuple[str, str]:
    """The recurrence once per row, to emit the state after each: inputs [B, M, ...] each.
    Returns (output [B, M, nv*dv], window [M, B, nv, dk, dv])."""
    per_row = [g.op("Split", [t, g.const([1] * rows)], num_outputs=rows, axis=1) if rows > 1 else [t] for t in inputs]
    outputs, states = [], []
    for row_inputs in zip(*per_row):
        out, state = recurrence(state, *row_inputs)
        outputs.append(out)
        states.append(state)
    output = g.op("Concat", outputs, axis=1) if rows > 1 else outputs[0]
    # Unsqueeze aliases its input; the Concat then writes straight into the graph output
    window = g.op("Concat", [g.op("Unsqueeze", [s, g.const([0])]) for s in states], axis=0)  # [M, B, nv, dk, dv]
    return output, window
