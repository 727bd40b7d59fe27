"""Whole-model graphs: the target forward (prefill / decode / verify) and the MTP head.

Target graph I/O (B requests, M rows each, L = max_length):
  in   input_ids int64 [B, M]   positions int64 [B, M]
       key.{i} [B, kvh, hd, W], value.{i} [B, kvh, W, hd]            full-attention layer i: the
                         cache's first W <= L slots, W past every position of the call (any such
                         W gives the same bits; the CPU runtime passes a window, CUDA all L)
       conv.{i} [B, K-1, C], recurrent.{i} [B, nv, dk, dv] (fp32)     GDN layer i
    or (gdn_verify="state_window" verifies) conv.{i}.past{M} [M, B, K-1, C], recurrent.{i}.past{M}
                         [M, B, nv, dk, dv]: the ops' past windows, the live state in slot M-1
  out  tokens int64 [B, M] (argmax)  logits [B, M, V] float32  hidden [B, M, H] (final-normed, in the
       activations' dtype: float32, or the model's with convert(activations="model")); a prefill's
       tokens [B, 1] and logits [B, 1, V] are its last row's alone
       new_key.{i} [B, kvh, hd, M], new_value.{i} [B, kvh, M, hd]     rows to write at positions
       conv_out.{i}, recurrent_out.{i}                                states after the last row
    or conv_window.{i} [M, ...], recurrent_window.{i} [M, ...]       state after each row (select)
    or (CPU variants) conv_window.{i}.{j}, recurrent_window.{i}.{j}  the state after row j, one
                         output per row (manifest.window_row_name): no stacking copy
    or (gdn_verify="transition") conv_inputs.{i} [B, M, C], gdn_keys.{i} [B, M, nk, dk],
                         gdn_values.{i} [B, M, nv*dv], gdn_decay.{i}, gdn_beta.{i} [B, M, nv]: the
                         rows' transition record (manifest.TRANSITION_RECORD), no state at all

MTP graph I/O: in input_ids [B, M] (the token after each hidden's position), hidden [B, M, H]
(target final-normed hidden, or the MTP's own output when drafting), positions [B, M],
key.mtp, value.mtp; out tokens, logits, hidden_out [B, M, H] (after mtp.norm), new_key.mtp,
new_value.mtp. hidden and hidden_out are in the activations' dtype (the target's hidden output
feeds the head as it is); logits and every state are float32.
"""

from __future__ import annotations

from onnx import TensorProto

from ..manifest import graph_name, past_window_name, window_row_name
from ..model_spec import FULL, ModelSpec
from .builder import CPU, PORTABLE, GraphBuilder, WeightStore
from .draft_vocab import DRAFT_HEAD, DRAFT_TOKENS
from .gdn_cpu import make_gated_deltanet_rows
from .layers import (
    make_add_rms_norm,
    make_attention,
    make_attention_context,
    make_attention_rows,
    make_gated_deltanet,
    make_kv_step,
    make_mlp,
    make_one_row_steps,
    make_rms_norm,
    make_step_inputs,
)
from .sampling_graph import RowParams, draft_sampler, make_sampled_tokens

F32, I64 = TensorProto.FLOAT, TensorProto.INT64


WINDOW = "W"  # the KV slots a graph attends over: the first W of the cache's max_length


def state_shapes(spec: ModelSpec, batch="B") -> dict[str, list]:
    """Graph input name -> shape of every per-layer state of the target model."""
    shapes = {}
    for i, kind in enumerate(spec.layer_types):
        if kind == FULL:
            shapes[f"key.{i}"] = [batch, spec.num_key_value_heads, spec.head_dim, WINDOW]
            shapes[f"value.{i}"] = [batch, spec.num_key_value_heads, WINDOW, spec.head_dim]
        else:
            shapes[f"conv.{i}"] = [batch, spec.linear_conv_kernel_dim - 1, spec.conv_dim]
            shapes[f"recurrent.{i}"] = [batch, spec.linear_num_value_heads, spec.linear_key_head_dim,
                                        spec.linear_value_head_dim]
    return shapes


def mtp_state_shapes(spec: ModelSpec, batch="B", window=WINDOW) -> dict[str, list]:
    """window: the name of the slots dimension (a graph with target caches too names its own)."""
    return {
        "key.mtp": [batch, spec.num_key_value_heads, spec.head_dim, window],
        "value.mtp": [batch, spec.num_key_value_heads, window, spec.head_dim],
    }


def _state_input(g: GraphBuilder, name: str, shape: list, past: int) -> str:
    """The graph input of state ``name``; a GDN state of a state_window verify of ``past`` rows is
    its past window [past, B, ...] (manifest.past_window_name), whose last slot the ops read."""
    if past and name.startswith(("conv.", "recurrent.")):
        return g.input(past_window_name(name, past), F32, [past, *shape])
    return g.input(name, F32, shape)


def _decoder_layer(g, spec, x, residual, prefix, mixer):
    """Pre-norm block; `residual` is None for the first layer. Returns (mlp_out, residual)."""
    eps = spec.rms_norm_eps
    if residual is None:
        residual, h = x, make_rms_norm(g, x, f"{prefix}.in_norm", eps)
    else:
        h, residual = make_add_rms_norm(g, x, residual, f"{prefix}.in_norm", eps)
    h = mixer(h)
    h, residual = make_add_rms_norm(g, h, residual, f"{prefix}.post_norm", eps)
    return make_mlp(g, spec, h, prefix), residual


def _head(g, spec, x, residual, norm_weight, hidden_name, rows, choose, last_only=False):
    """Final norm, lm_head; the logits float32 whatever the activations (argmax ties and sampling
    see the values the runtime reads), the hidden rows in the activations' dtype. choose(logits)
    -> the tokens [B, M] (None: the argmax). last_only (a prefill) scores the last row alone:
    only that row's token is chosen, and scoring every row of a long prompt costs M x V logits
    (half a GB for 512 prompt tokens at a 248,320-token vocabulary) and M lm_head products; a
    weight product's row has the same bits alone as among others (tools/row_invariance.py)."""
    hidden, _ = make_add_rms_norm(g, x, residual, norm_weight, spec.rms_norm_eps)
    scored, scored_rows = hidden, rows
    if last_only:
        scored, scored_rows = g.op("Slice", [hidden, g.const([-1]), g.const([2 ** 62]), g.const([1])]), 1
    logits = g.linear(scored, "lm_head", out_dtype=F32)
    tokens = g.op("ArgMax", [logits], axis=-1, keepdims=0) if choose is None else choose(logits)
    g.output(tokens, "tokens", I64, ["B", scored_rows])
    g.output(logits, "logits", F32, ["B", scored_rows, spec.vocab_size])
    g.output(hidden, hidden_name, g.activations, ["B", rows, spec.hidden_size])


def make_target_graph(spec: ModelSpec, store: WeightStore, max_length: int, name: str,
                      rows: int | None, windows: bool = False, layers: range | None = None,
                      stage: int = 0, target: str = PORTABLE, gdn_verify: str = "per_row",
                      choose=None) -> GraphBuilder:
    """rows=None: any M (prefill); rows=M: static M (decode M=1, verify M=k+1).
    choose(g, logits [B, M, V]) -> tokens [B, M]: what the ``tokens`` output holds (None: the
    argmax; ``decode_sample``: a draw).
    windows=True (needs static rows): GDN states after every row, for the select commit; the
    portable graph in the form gdn_verify (manifest.GDN_VERIFY_FORMS: per-row windows, the ops'
    state_window, or the transition record), a CPU graph always per row.
    target: the formulations (builder.GraphBuilder); a CPU graph of static M runs its GDN
    layers as converter/gdn_cpu.py builds them.
    layers: a pipeline stage (a contiguous range of layers). The first stage embeds the ids;
    a later stage takes the proxies ``proxy.hidden`` and ``proxy.residual`` [B, M, H] (token
    rows) from the stage before; every stage but the last hands its own on. A stage after one
    that ran no layer gets no residual: that proxy is legitimately absent."""
    layers = range(spec.num_layers) if layers is None else layers
    first, last = stage == 0, layers.stop == spec.num_layers
    g = GraphBuilder(name, store, target)
    dim_m = rows if rows is not None else "M"
    positions = g.input("positions", I64, ["B", dim_m])
    if first:
        x, residual = g.embedding(g.input("input_ids", I64, ["B", dim_m])), None
    else:
        x = g.input("proxy.hidden", g.activations, ["B", dim_m, spec.hidden_size])
        residual = (g.input("proxy.residual", g.activations, ["B", dim_m, spec.hidden_size]) if layers.start > 0
                    else None)
    past = rows if windows and gdn_verify == "state_window" and target == PORTABLE else 0  # the ops' past windows
    states = {n: _state_input(g, n, shape, past) for n, shape in state_shapes(spec).items()
              if int(n.split(".")[1]) in layers}
    window = next((n for n in states if n.startswith("key.")), None)  # all attention layers get one window width
    step = make_step_inputs(g, spec, positions, max_length, window=window, rows=rows)
    state_outputs = []
    for i in layers:
        prefix = f"L{i}"
        if spec.layer_types[i] == FULL:
            def mixer(h, i=i, prefix=prefix):
                out, new_key, new_value = make_attention(g, spec, h, prefix, step, states[f"key.{i}"], states[f"value.{i}"])
                state_outputs.append((new_key, f"new_key.{i}"))
                state_outputs.append((new_value, f"new_value.{i}"))
                return out
        else:
            def mixer(h, i=i, prefix=prefix):
                conv_state, recurrent_state = states[f"conv.{i}"], states[f"recurrent.{i}"]
                if target == CPU and rows is not None:
                    out, conv, rec = make_gated_deltanet_rows(g, spec, h, prefix, conv_state, recurrent_state, rows,
                                                              windows)
                else:
                    out, conv, rec = make_gated_deltanet(g, spec, h, prefix, conv_state, recurrent_state,
                                                         per_position=rows if windows else 0, verify=gdn_verify)
                for kind, value in (("conv", conv), ("recurrent", rec)):
                    name = f"{kind}_{'window' if windows else 'out'}.{i}"
                    if isinstance(value, list):  # the CPU variants: the state after each row, one output each
                        state_outputs.extend((v, window_row_name(name, j)) for j, v in enumerate(value))
                    elif isinstance(value, dict):  # a transition record: its vectors, no state
                        state_outputs.extend((v, f"{part}.{i}") for part, v in value.items())
                    else:
                        state_outputs.append((value, name))
                return out
        x, residual = _decoder_layer(g, spec, x, residual, prefix, mixer)
    if last:
        _head(g, spec, x, residual, "final_norm", "hidden", dim_m, None if choose is None else
              (lambda logits: choose(g, logits)), last_only=rows is None)
    else:
        g.output(x, "proxy.hidden", g.activations, ["B", dim_m, spec.hidden_size])
        if residual is not None:
            g.output(residual, "proxy.residual", g.activations, ["B", dim_m, spec.hidden_size])
    for value, out_name in state_outputs:
        g.output(value, out_name, F32, None)
    return g


def sampled_tokens(spec: ModelSpec):
    """``decode_sample``'s choice: (g, logits [B, 1, V]) -> tokens [B, 1], a draw for rows with
    temperature > 0, the argmax for the others (converter/sampling_graph.py), with its inputs:
    temperature, top_k, top_p, min_p [B] and uniforms float [B, 1]."""
    def choose(g: GraphBuilder, logits: str) -> str:
        params, uniforms = RowParams.inputs(g), g.input("uniforms", F32, ["B", 1])
        return make_sampled_tokens(g, logits, params, uniforms, spec.vocab_size)

    return choose


def make_sample_logits_graph(spec: ModelSpec, store: WeightStore, target: str = PORTABLE) -> GraphBuilder:
    """``sample_logits``: tokens [B, 1] chosen from logits [B, 1, V] as ``decode_sample`` chooses
    (a draw for rows with temperature > 0, the argmax for the others), with its inputs. A prefill's
    logits are its last row's alone, so its sampled first tokens are drawn here, where the logits
    lie, instead of on the host: no [B, V] download, and no numpy transform, which sorts the whole
    vocabulary on the engine's thread for a top-p request. No weights: no second prefill graph."""
    g = GraphBuilder("sample_logits", store, target)
    logits = g.input("logits", F32, ["B", 1, spec.vocab_size])
    g.output(sampled_tokens(spec)(g, logits), "tokens", I64, ["B", 1])
    return g


def mtp_lm_head(store: WeightStore) -> str:
    """The MTP head's own full-vocabulary lm_head when it has one (an int4 draft head without a
    draft vocabulary), else the shared one: what the one-pass "mtp" graph scores."""
    return "mtp.lm_head" if "mtp.lm_head" in store.arrays else "lm_head"


def draft_vocab_size(store: WeightStore, spec: ModelSpec) -> int:
    """The tokens a draft scores: N with a draft vocabulary (converter/draft_vocab.py), else V."""
    return store.arrays[DRAFT_TOKENS].size if DRAFT_TOKENS in store.arrays else spec.vocab_size


def draft_logits(g: GraphBuilder, rows: str) -> str:
    """The head's float32 logits for its normed rows [B, 1, H]: [B, 1, N] over the draft
    vocabulary where the model has one, else [B, 1, V]."""
    weight = DRAFT_HEAD if DRAFT_HEAD in g.weights.arrays else mtp_lm_head(g.weights)
    return g.linear(rows, weight, out_dtype=F32)


def to_full_vocabulary(g: GraphBuilder, spec: ModelSpec, draft: str, probs: str | None) -> tuple[str, str | None]:
    """A draft chosen over the draft vocabulary -> its full-vocabulary id [B, 1] (a Gather over
    draft_tokens), and its distribution [B, 1, N] -> [B, 1, V], scattered into zeros (q = 0 outside
    the map, which keeps speculative sampling exact); both unchanged without a draft vocabulary.

        draft [B, 1] ─ Gather(draft_tokens) ─ full id
        draft ─ Unsqueeze ─ Mul 0 ─ zero [B, 1, 1] ─┬─ Add(draft_tokens) ─ index [B, 1, N] ─┐
                                                    └─ Cast ─ Add(ConstantOfShape [V]) ─ ScatterElements(probs) ─ [B, 1, V]

    (the zero carries the batch dimension without a shape op: a CUDA graph may not hold one)."""
    if DRAFT_TOKENS not in g.weights.arrays:
        return draft, probs
    tokens = g.weight(DRAFT_TOKENS)
    full = g.op("Gather", [tokens, draft], hint="draft")  # [B, 1]
    if probs is None:
        return full, None
    zero = g.op("Mul", [g.op("Unsqueeze", [draft, g.const([2])]), g.const(0)])  # [B, 1, 1] int64
    index = g.op("Add", [zero, tokens])  # [B, 1, N]
    zeros = g.op("Add", [g.op("Cast", [zero], to=F32), g.op("ConstantOfShape", [g.const([spec.vocab_size])])])
    return full, g.op("ScatterElements", [zeros, index, probs], axis=-1, hint="draft_probs")  # [B, 1, V]


def _mtp_pass(g: GraphBuilder, spec: ModelSpec, ids: str, hidden: str, step, past_key: str, past_value: str):
    """One pass of the MTP head over M rows: fc(concat(norm_e(embed(x_{p+1})), norm_h(h_p))) ->
    attention layer (own KV) -> mtp.norm. Returns (hidden_out, new_key, new_value, merged key
    view, merged value view); the caller applies the lm_head to the rows it needs."""
    eps = spec.rms_norm_eps
    embedded = make_rms_norm(g, g.embedding(ids), "mtp.pre_embed", eps)
    normed_hidden = make_rms_norm(g, hidden, "mtp.pre_hidden", eps)
    x = g.linear(g.op("Concat", [embedded, normed_hidden], axis=-1), "mtp.fc", hint="mtp.fc_out")
    cache = []

    def mixer(h):
        out, *kv = make_attention(g, spec, h, "mtp.L0", step, past_key, past_value, merged=True)
        cache.extend(kv)
        return out

    x, residual = _decoder_layer(g, spec, x, None, "mtp.L0", mixer)
    hidden_out, _ = make_add_rms_norm(g, x, residual, "mtp.norm", eps)
    return (hidden_out, *cache)


def make_mtp_graph(spec: ModelSpec, store: WeightStore, max_length: int, target: str = PORTABLE) -> GraphBuilder:
    """MTP head, one pass (the layer-level reference the tests compare with torch):

           input_ids ─ embed ─ pre_embed norm ─┐
                                               Concat ─ MatMul(fc) ─ decoder layer (own KV) ─ mtp.norm ─ lm_head
           hidden ──────────── pre_hidden norm ┘
    """
    g = GraphBuilder("mtp", store, target)
    ids = g.input("input_ids", I64, ["B", "M"])
    hidden = g.input("hidden", g.activations, ["B", "M", spec.hidden_size])
    positions = g.input("positions", I64, ["B", "M"])
    states = {n: g.input(n, F32, shape) for n, shape in mtp_state_shapes(spec).items()}
    step = make_step_inputs(g, spec, positions, max_length, window="key.mtp")
    hidden_out, new_key, new_value, _, _ = _mtp_pass(g, spec, ids, hidden, step, states["key.mtp"], states["value.mtp"])
    logits = g.linear(hidden_out, mtp_lm_head(store), out_dtype=F32)
    g.output(g.op("ArgMax", [logits], axis=-1, keepdims=0), "tokens", I64, ["B", "M"])
    g.output(logits, "logits", F32, ["B", "M", spec.vocab_size])
    g.output(hidden_out, "hidden_out", g.activations, ["B", "M", spec.hidden_size])
    g.output(new_key, "new_key.mtp", F32, None)
    g.output(new_value, "new_value.mtp", F32, None)
    return g


def make_mtp_propose_graph(spec: ModelSpec, store: WeightStore, max_length: int, k: int,
                           sample: bool = False, target: str = PORTABLE) -> GraphBuilder:
    """The MTP head's whole share of a step in one graph (one Run instead of k): the catch-up
    over M rows of target hiddens, then k-1 recursive draft passes (``add_mtp_propose``).

      in   input_ids [B, M] (x_{p+1} per row), hidden [B, M, H], positions [B, M],
           last int64 [B] (row a: the last real row of each request), key.mtp, value.mtp
      out  drafts int64 [B, k]: d1 = argmax at row a, d_{j+1} from (d_j, the pass's own
           normed output) at position T+a+j; new_key.mtp, new_value.mtp: the catch-up's rows
           (the runtime writes rows 0..a; the draft passes' rows stay inside the graph)

    sample=True (``mtp_sample_k{k}``) draws each draft instead of taking the argmax, for the
    rows with temperature > 0 (converter/sampling_graph.py):
      in   temperature float [B] (0: greedy row), top_k int64 [B], top_p float [B], min_p float [B],
           uniforms [B, k]
      out  draft_probs [B, k, V]: the distribution each draft was drawn from
    """
    g = GraphBuilder(graph_name("mtp_sample" if sample else "mtp_propose", k), store, target)
    ids = g.input("input_ids", I64, ["B", "M"])
    hidden = g.input("hidden", g.activations, ["B", "M", spec.hidden_size])
    positions = g.input("positions", I64, ["B", "M"])
    last = g.input("last", I64, ["B"])
    states = {n: g.input(n, F32, shape) for n, shape in mtp_state_shapes(spec).items()}
    choose = _draft_sampler(g, spec, k) if sample else draft_argmax(g)
    drafts, draft_probs = add_mtp_propose(g, spec, max_length, k, ids, hidden, positions, last, states, choose)
    g.output(drafts, "drafts", I64, ["B", k])
    if sample:
        g.output(draft_probs, "draft_probs", F32, ["B", k, spec.vocab_size])
    return g


def add_mtp_propose(g: GraphBuilder, spec: ModelSpec, max_length: int, k: int, ids: str, hidden: str,
                    positions: str, last: str, states: dict[str, str], choose) -> tuple[str, str | None]:
    """The head's catch-up over M rows and its k drafts, added to graph g (``mtp_propose_k{k}``,
    and the head's share of ``verify_mtp_k{k}``). ids [B, M] x_{p+1}, hidden [B, M, H], positions
    [B, M], last [B] int64 (row a), states: key.mtp and value.mtp inputs; choose(logits, j) ->
    (draft [B, 1], probs [B, 1, V] or None). Declares new_key.mtp and new_value.mtp (the catch-up's
    rows); returns (drafts [B, k], their probabilities [B, k, V] or None). With a draft vocabulary
    choose sees [B, 1, N] logits, and its choice is mapped back to full ids and [B, 1, V]
    (``to_full_vocabulary``).

    Each draft pass attends over the previous pass's merged cache view. Rows of the catch-up
    past a are padding: their slots lie after every draft's position, so the mask hides them.
    Draft positions are clamped to the constant L-1 (the runtime passes a window past T+a+k-1,
    or all L slots: near the end of max_length those drafts go unused). Every value feeding a
    compute op is a constant or an input, never derived from a shape (CUDA-graph capture).
    """
    last = g.op("Unsqueeze", [last, g.const([1])])  # [B, 1]

    def at_last(x):  # row a of each request: [B, M, ...] -> [B, 1, ...]
        return g.op("Unsqueeze", [g.op("GatherND", [x, last], batch_dims=1), g.const([1])])

    def draft_from(out, j):  # the lm_head on one row per request: [B, 1, H] -> [B, 1], [B, 1, V] or None
        draft, probs = choose(draft_logits(g, out), j)  # over the draft vocabulary (N or V tokens)
        return to_full_vocabulary(g, spec, draft, probs)

    catch_up = _catch_up_last_row if g.target != CPU else _catch_up_every_row
    out, key_view, value_view, draft_steps = catch_up(g, spec, max_length, k, ids, hidden, positions, states,
                                                      at_last)  # out [B, 1, H]: only row a drafts
    draft, probs = draft_from(out, 0)
    drafts, draft_probs = [draft], [probs]
    for j in range(1, k):
        out, _, _, key_view, value_view = _mtp_pass(g, spec, draft, out, draft_steps(j, key_view), key_view,
                                                    value_view)
        draft, probs = draft_from(out, j)
        drafts.append(draft)
        draft_probs.append(probs)
    drafts_out = g.op("Concat", drafts, axis=1) if k > 1 else draft
    if probs is None:
        return drafts_out, None
    return drafts_out, g.op("Concat", draft_probs, axis=1) if k > 1 else probs


# A draft's position stays below max_length; it needs no clamp to the window W: the runtime passes
# W >= (last position + k) unless W = max_length (runtime/model.py attention_window). (A clamp
# computed from the window's shape would be shape math that ONNX Runtime places on the CPU, and a
# CUDA graph may not hold CPU compute nodes: seen on the H200.)

def _catch_up_every_row(g, spec, max_length, k, ids, hidden, positions, states, at_last):
    """add_mtp_propose's catch-up on the CPU: the head's pass over all M rows, row a's output
    taken after it; each draft pass builds its own positions and bias. Returns (row a's output
    [B, 1, H], the merged key and value views, draft_steps(j, key view) -> pass j's StepInputs)."""
    step = make_step_inputs(g, spec, positions, max_length, window=states["key.mtp"])
    out, new_key, new_value, key_view, value_view = _mtp_pass(
        g, spec, ids, hidden, step, states["key.mtp"], states["value.mtp"])
    g.output(new_key, "new_key.mtp", F32, None)
    g.output(new_value, "new_value.mtp", F32, None)
    out, base = at_last(out), at_last(positions)  # [B, 1, H], [B, 1]
    last_slot = g.const([max_length - 1])

    def draft_steps(j, key_view):
        position = g.op("Min", [g.op("Add", [base, g.const([j])]), last_slot])
        return make_step_inputs(g, spec, position, max_length, window=key_view, rows=1)

    return out, key_view, value_view, draft_steps


def _catch_up_last_row(g, spec, max_length, k, ids, hidden, positions, states, at_last):
    """add_mtp_propose's catch-up on the portable graphs: every row writes its KV rows (the same
    ops as the pass over all rows), but only row a attends and runs the rest of the layer, since
    only row a's output drafts: its query, gate and residual are gathered before the attention,
    which then runs as a one-row pass (no row Transposes, one bias row). Row a's bias and every
    draft pass's positions, bias and scatter indices are made together (make_one_row_steps).
    Returns what _catch_up_every_row returns."""
    eps = spec.rms_norm_eps
    rows_step = make_kv_step(g, positions, max_length, window=states["key.mtp"])
    embedded = make_rms_norm(g, g.embedding(ids), "mtp.pre_embed", eps)
    normed_hidden = make_rms_norm(g, hidden, "mtp.pre_hidden", eps)
    x = g.linear(g.op("Concat", [embedded, normed_hidden], axis=-1), "mtp.fc", hint="mtp.fc_out")  # [B, M, H]
    q, gate, new_key, new_value, key_view, value_view = make_attention_rows(
        g, spec, make_rms_norm(g, x, "mtp.L0.in_norm", eps), "mtp.L0", rows_step, states["key.mtp"],
        states["value.mtp"])
    g.output(new_key, "new_key.mtp", F32, None)
    g.output(new_value, "new_value.mtp", F32, None)
    base = at_last(positions)  # [B, 1]: row a's position
    if k > 1:  # row a, then the draft passes at T+a+1 .. T+a+k-1
        base = g.op("Min", [g.op("Add", [base, g.const(range(k))]), g.const([max_length - 1])])  # [B, k]
    steps = make_one_row_steps(g, spec, base, k, rows_step.slots, scatter_from=1)  # the views' W is key.mtp's
    attended = make_attention_context(g, spec, at_last(q), at_last(gate), key_view, value_view, "mtp.L0", steps[0])
    h, residual = make_add_rms_norm(g, attended, at_last(x), "mtp.L0.post_norm", eps)
    out, _ = make_add_rms_norm(g, make_mlp(g, spec, h, "mtp.L0"), residual, "mtp.norm", eps)  # [B, 1, H]
    return out, key_view, value_view, lambda j, key_view: steps[j]


def draft_argmax(g: GraphBuilder):
    """(logits [B, 1, N], pass j) -> (the argmax draft [B, 1], None): mtp_propose_k{k}'s (and
    verify_mtp_k{k}'s) choice, over the draft vocabulary's N tokens (V without one)."""
    return lambda logits, j: (g.op("ArgMax", [logits], axis=-1, keepdims=0), None)


def _draft_sampler(g: GraphBuilder, spec: ModelSpec, k: int):
    """The sampling graph's inputs, and (logits [B, 1, N], pass j) -> (draft [B, 1], probs [B, 1, N]):
    N the draft vocabulary's tokens (V without one)."""
    params = RowParams.inputs(g)
    return draft_sampler(g, params, g.input("uniforms", F32, ["B", k]), 0, draft_vocab_size(g.weights, spec))
