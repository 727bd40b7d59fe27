"""The Gated DeltaNet layer of a fixed-M graph built for the CPU (decode, verify, verify_select).

Why a second formulation: ONNX Runtime's CPU kernels of the fused ops that make the portable
layer (layers.make_gated_deltanet) one kernel each on CUDA cost far more per row than the same
math as plain ops (measured per op: docs/history.md, "Speculation on the CPU"):

    LinearAttention          ->  the per-row ops below
    CausalConvWithState      ->  gathered taps, Mul, ReduceSum
    GatedRMSNorm             ->  RMSNorm per head, QuickGelu

::

    x ─ MatMul(in_proj) ─ Split ─┬ qkv ─ Concat(conv tail) ─ Gather(taps) ─ Mul(w) ─ ReduceSum ─ QuickGelu ─ q, k, v
                                 ├ z ─────────────────────────────────────────────────────────────────────────┐
                                 └ b, a ─ LinearAttentionGate ─ g, β                                            │
        q, k ─ l2norm ─ rows j = 0..M-1 (_recurrence_rows) ─ o ─ RMSNorm per head ─ Mul(QuickGelu(z)) ─ MatMul(out)

Exactness: a decode (M=1) and a verify (M=k+1) run each row's recurrence through the same ops
at the same shapes ([B, nv, ...]); every other op is row-wise, so row j gets the same bits
either way (tools/row_invariance.py checks the layer, M rows with state windows against M
one-row decodes, bit for bit). The prefill (any M) keeps LinearAttention and
CausalConvWithState: its states start a plain and a speculative decode alike. The conv state is
data movement (the last K-1 pre-conv inputs), so it has the fused op's bits exactly.

Axes are counted from the end wherever a tensor may or may not carry the row axis: a verify's
per-row inputs are [B, M, nv, ...] and each row is gathered out of them; a decode builds them
[B, nv, ...] straight away (one row: nothing to gather, fewer nodes per step).
"""

from __future__ import annotations

from ..model_spec import ModelSpec
from .builder import GraphBuilder
from .layers import F32, l2_normalize, make_gated_norm_chain, make_silu


def make_gated_deltanet_rows(g: GraphBuilder, spec: ModelSpec, x: str, prefix: str, conv_state: str,
                             recurrent_state: str, rows: int, windows: bool = False):
    """As layers.make_gated_deltanet for a static row count M (``rows``): returns (output
    [B, M, H], conv, recurrent): the states after the last row [B, K-1, C] and [B, nv, dk, dv],
    or with windows=True the state after each row, as lists of M tensors [B, K-1, C] and
    [B, nv, dk, dv]: one graph output each (``manifest.window_row_name``). Stacking them into
    one [M, B, ...] window, as the portable graphs do, copied every state once more, and the
    select commit copies one row out of them either way."""
    nv, kd, vd, C = spec.linear_num_value_heads, spec.linear_key_dim, spec.linear_value_dim, spec.conv_dim
    qkv, z, b, a = g.op("Split", [g.linear(x, f"{prefix}.in_proj", out_dtype=F32), g.const([C, vd, nv, nv])],
                        num_outputs=4, axis=-1)  # [B, M, C], [B, M, vd], [B, M, nv] x 2, float32
    decay, beta = g.ms("LinearAttentionGate", [a, g.weight(f"{prefix}.dt_bias"), g.weight(f"{prefix}.decay_scale"), b],
                       num_outputs=2)  # [B, M, nv] each; decay in log space
    mixed, conv = _conv_rows(g, spec, f"{prefix}.conv_taps", conv_state, qkv, rows, windows)
    q, k, v = g.op("Split", [mixed, g.const([kd, kd, vd])], num_outputs=3, axis=-1)
    heads, recurrent = _recurrence_rows(g, spec, recurrent_state, q, k, v, decay, beta, rows, windows)
    normed = make_gated_norm_chain(g, spec, heads, z, f"{prefix}.gdn_norm")  # [B, M, vd]
    return g.linear(normed, f"{prefix}.out", hint=f"{prefix}.gdn_out", x_dtype=F32), conv, recurrent


def _conv_rows(g: GraphBuilder, spec: ModelSpec, taps_weight: str, conv_state: str, qkv: str, rows: int,
               windows: bool) -> tuple[str, str]:
    """Depthwise causal conv (kernel K) + SiLU over qkv [B, M, C]: row j's output is
    silu(sum_t w[t] * inputs[j + t]) over the K inputs ending at j (the conv tail, then this
    call's rows); taps_weight w [K, C] is the conv weight tap-major. Returns (output [B, M, C],
    the conv state after the last row [B, K-1, C], or after each row: M of them)."""
    K = spec.linear_conv_kernel_dim
    inputs = g.op("Concat", [conv_state, qkv], axis=1)  # [B, K-1+M, C]
    taps = g.op("Gather", [inputs, g.const([[j + t for t in range(K)] for j in range(rows)])], axis=1)  # [B, M, K, C]
    summed = g.op("ReduceSum", [g.op("Mul", [taps, g.weight(taps_weight)]), g.const([2])], keepdims=0)  # [B, M, C]
    last_rows = range(rows) if windows else [rows - 1]  # the state after row j: inputs j+1 .. j+K-1
    states = [g.op("Slice", [inputs, g.const([j + 1]), g.const([j + K]), g.const([1])])  # [B, K-1, C]
              for j in last_rows]
    return make_silu(g, summed), (states if windows else states[0])


def _recurrence_rows(g: GraphBuilder, spec: ModelSpec, state: str, q: str, k: str, v: str, decay: str, beta: str,
                     rows: int, windows: bool) -> tuple[str, str]:
    """The gated delta rule one row at a time. Per value head (key head h // r, r = nv / nk),
    with e = exp(g) and q̂ the scaled, normalized query:

        u  = β (v − e Sᵀk)
        S' = e S + k uᵀ
        o  = S'ᵀ q̂ = e Sᵀq̂ + (kᵀq̂) u

    so Sᵀk and Sᵀq̂ are one product per row (rows βe·k and e·q̂ against S) and o needs no pass
    over S'. Inputs: q, k [B, M, kd] (pre-norm), v [B, M, nv*dv], decay (g), beta [B, M, nv].
    Everything per row is [B, nv, ...], the state's own layout, so each row's state is written
    once, by its Add, straight into the graph output (a Reshape there would copy it).
    Returns (o [B, M, nv, dv], the state after the last row [B, nv, dk, dv], or after each row:
    M of them, each the Add that computed it, so a graph output without a copy)."""
    nv, dk, dv = spec.linear_num_value_heads, spec.linear_key_head_dim, spec.linear_value_head_dim
    lead = [0, 0] if rows > 1 else [-1]  # [B, M, ...] for a verify, [B, ...] for a decode
    e = g.op("Reshape", [g.op("Exp", [decay]), g.const(lead + [nv, 1, 1])])  # [B, (M,) nv, 1, 1]
    beta = g.op("Reshape", [beta, g.const(lead + [nv, 1, 1])])
    q = _value_head_rows(g, spec, q, lead, scale=dk ** -0.5)  # [B, (M,) nv, 1, dk]: q̂, LinearAttention's scale
    k = _value_head_rows(g, spec, k, lead)
    factors = g.op("Concat", [g.op("Mul", [beta, e]), e], axis=-2)  # [.., nv, 2, 1]: βe, e
    kq = g.op("Mul", [g.op("Concat", [k, q], axis=-2), factors])  # [.., nv, 2, dk]: βe·k, e·q̂
    k_dot_q = g.op("ReduceSum", [g.op("Mul", [k, q]), g.const([-1])], keepdims=1)  # [.., nv, 1, 1]
    k_column = g.op("Reshape", [k, g.const(lead + [nv, dk, 1])])  # [.., nv, dk, 1]
    beta_v = g.op("Mul", [beta, g.op("Reshape", [v, g.const(lead + [nv, 1, dv])])])  # [.., nv, 1, dv]
    s, outputs, states = state, [], []  # s [B, nv, dk, dv]
    for j in range(rows):
        kq_j, k_dot_q_j, k_column_j, beta_v_j, e_j = (
            _row(g, t, j, rows) for t in (kq, k_dot_q, k_column, beta_v, e))  # [B, nv, ...]
        kv, sq = g.op("Split", [g.op("MatMul", [kq_j, s]), g.const([1, 1])], num_outputs=2, axis=-2)  # βe Sᵀk, e Sᵀq̂
        u = g.op("Sub", [beta_v_j, kv])  # [B, nv, 1, dv]
        outputs.append(g.op("Add", [sq, g.op("Mul", [u, k_dot_q_j])]))  # [B, nv, 1, dv]
        s = g.op("Add", [g.op("Mul", [s, e_j]), g.op("MatMul", [k_column_j, u])])  # [B, nv, dk, dv]
        states.append(s)
    stacked = _stack(g, outputs, axis=1) if rows > 1 else outputs[0]  # [B, M, nv, 1, dv], or a decode's [B, nv, 1, dv]
    heads = g.op("Reshape", [stacked, g.const([0, rows, nv, dv])])  # [B, M, nv, dv]
    return heads, (states if windows else s)


def _value_head_rows(g: GraphBuilder, spec: ModelSpec, x: str, lead: list[int], scale: float = 1.0) -> str:
    """[B, M, nk*dk] -> l2-normalized per key head, [B, (M,) nv, 1, dk]: value head h reads key
    head h // (nv/nk), as transformers' repeat_interleave (LinearAttention's "inverse GQA")."""
    nk, nv, dk = spec.linear_num_key_heads, spec.linear_num_value_heads, spec.linear_key_head_dim
    x = l2_normalize(g, x, nk, dk, scale, shape=lead + [nk, 1, dk])  # [.., nk, 1, dk]
    if nv == nk:
        return x
    repeated = g.op("Expand", [x, g.const([1] * len(lead) + [1, nv // nk, 1])])  # [.., nk, r, dk]
    return g.op("Reshape", [repeated, g.const(lead + [nv, 1, dk])])


def _row(g: GraphBuilder, x: str, j: int, rows: int) -> str:
    """Row j of a per-row input: [B, M, ...] -> [B, ...]; a decode's is already [B, ...]."""
    return x if rows == 1 else g.op("Gather", [x, g.const(j)], axis=1)


def _stack(g: GraphBuilder, rows: list[str], axis: int) -> str:
    """M > 1 tensors [...] -> one with a new axis of M (Unsqueeze aliases its input: the Concat
    writes each row once)."""
    return g.op("Concat", [g.op("Unsqueeze", [t, g.const([axis])]) for t in rows], axis=axis)
