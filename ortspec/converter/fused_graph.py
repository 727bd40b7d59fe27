"""``verify_mtp_k{k}``: a greedy speculative step's device work in one graph, so one Run per step.

Without it a step runs two graphs: the verify (``verify_select_k{k}``), then, once the host has
read the target's tokens and worked out the accept lengths, the MTP head's catch-up and next
drafts (``mtp_propose_k{k}``): two Runs, two waits for the device, on CUDA two graph replays.
For greedy rows the head needs nothing the host decides: the token after position T+i is the
target's own argmax g_i for every row i <= a (the accepted drafts equal g_0..g_{a-1}, and the
bonus is g_a), and a itself follows from the tokens. So the graph computes a and feeds the head:

    input_ids [B, k+1] (x_T, d1..dk) ─ verify_select_k{k} ─ tokens g [B, k+1], hidden [B, k+1, H],
                                                             logits, new KV rows, GDN windows
    d1..dk, g_0..g_{k-1} ─ greedy acceptance ─ accepted a [B]
    (g, hidden, positions, a) ─ MTP catch-up + k-1 draft passes ─ drafts [B, k], new_key.mtp, new_value.mtp
    step_ids [B, 2k+2] = g | a | drafts          (the host reads this one array per step)

  in   the verify_select_k{k} inputs, and key.mtp [B, kvh, hd, Wm], value.mtp [B, kvh, Wm, hd]
       (the head's cache window Wm reaches k slots further than the target's W: its drafts)
  out  the verify_select_k{k} outputs; accepted int64 [B]; drafts int64 [B, k]; step_ids int64
       [B, 2k+2]; new_key.mtp, new_value.mtp (the runtime writes rows 0..a, as after mtp_propose)

Both halves are built by the functions that build the two graphs it replaces, so each computes
the same bits (tests/test_fused_verify.py compares them).

``verify_mtp_sample_k{k}`` is the same step for batches where rows sample: exact speculative
sampling (converter/sampling_graph.py) decides a and the emitted token e_a of sampled rows,
the greedy rule those of greedy rows, and the head catches up over the emitted tokens and draws
its next drafts:

    ids (x_T, d1..dk), draft_probs q [B, k, V] ─ verify ─ p_0..p_k ─ accept / residual ─ a, e [B, k+1]
    (e, hidden, positions, a) ─ MTP catch-up + k-1 draft passes, drawn ─ d'1..d'k, draft_probs_out
    step_ids [B, 2k+2] = e_0..e_k | a | d'1..d'k

  in   verify_mtp_k{k}'s; temperature, top_k, top_p, min_p [B]; uniforms float [B, 2k+1]
       (columns 0..k-1 the acceptances, k the emitted token, k+1..2k the drafts);
       draft_probs float [B, k, V] (what d1..dk were drawn from)
  out  verify_mtp_k{k}'s (step_ids as above: e_i = d_{i+1} for i < a, e_a emitted; a greedy row's
       are its argmaxes, bit for bit); draft_probs_out [B, k, V] (what d'1..d'k were drawn from)
"""

from __future__ import annotations

from onnx import TensorProto

from ..manifest import graph_name
from ..model_spec import ModelSpec
from .builder import PORTABLE, GraphBuilder, WeightStore
from .graphs import add_mtp_propose, draft_argmax, draft_vocab_size, make_target_graph, mtp_state_shapes
from .sampling_graph import RowParams, draft_sampler, make_sampled_step_ids

F32, I64 = TensorProto.FLOAT, TensorProto.INT64
MTP_WINDOW = "Wm"  # the head's cache slots: its own dimension, apart from the target caches' W


def make_verify_mtp_graph(spec: ModelSpec, store: WeightStore, max_length: int, k: int,
                          target: str = PORTABLE, gdn_verify: str = "per_row") -> GraphBuilder:
    """verify_select_k{k}, the greedy acceptance and mtp_propose_k{k} in one graph (module docstring);
    target: the formulations (``builder``: the CPU variant runs the same ops as the CPU's other graphs);
    gdn_verify: the form of the portable graph's GDN outputs (manifest.GDN_VERIFY_FORMS)."""
    g = make_target_graph(spec, store, max_length, graph_name("verify_mtp", k), rows=k + 1, windows=True,
                          target=target, gdn_verify=gdn_verify)
    accepted = make_greedy_acceptance(g, "input_ids", "tokens", k)  # [B]
    states = {n: g.input(n, F32, shape) for n, shape in mtp_state_shapes(spec, window=MTP_WINDOW).items()}
    drafts, _ = add_mtp_propose(g, spec, max_length, k, "tokens", "hidden", "positions", accepted, states,
                                draft_argmax(g))  # [B, k]
    step_ids = g.op("Concat", ["tokens", g.op("Unsqueeze", [accepted, g.const([1])]), drafts], axis=1)
    g.output(accepted, "accepted", I64, ["B"])
    g.output(drafts, "drafts", I64, ["B", k])
    g.output(step_ids, "step_ids", I64, ["B", 2 * k + 2])
    return g


def make_verify_mtp_sample_graph(spec: ModelSpec, store: WeightStore, max_length: int, k: int,
                                 target: str = PORTABLE, gdn_verify: str = "per_row") -> GraphBuilder:
    """verify_mtp_k{k} with sampled rows (module docstring): their acceptance, emitted tokens and
    drafts drawn in the graph, so a step's host still reads one int64 array. The head samples over
    its draft vocabulary; q reaches the full vocabulary V inside add_mtp_propose."""
    vocab = spec.vocab_size
    name = graph_name("verify_mtp_sample", k)
    g = make_target_graph(spec, store, max_length, name, rows=k + 1, windows=True, target=target,
                          gdn_verify=gdn_verify)
    params = RowParams.inputs(g)
    uniforms = g.input("uniforms", F32, ["B", 2 * k + 1])
    q = g.input("draft_probs", F32, ["B", k, vocab])
    greedy = make_greedy_acceptance(g, "input_ids", "tokens", k)  # [B]
    emitted, accepted = make_sampled_step_ids(g, "input_ids", "tokens", "logits", params, q, uniforms, greedy, k,
                                              vocab)  # [B, k+1], [B]
    states = {n: g.input(n, F32, shape) for n, shape in mtp_state_shapes(spec, window=MTP_WINDOW).items()}
    drafts, draft_probs = add_mtp_propose(g, spec, max_length, k, emitted, "hidden", "positions", accepted, states,
                                          draft_sampler(g, params, uniforms, k + 1,
                                                        draft_vocab_size(g.weights, spec)))  # [B, k], [B, k, V]
    step_ids = g.op("Concat", [emitted, g.op("Unsqueeze", [accepted, g.const([1])]), drafts], axis=1)
    g.output(accepted, "accepted", I64, ["B"])
    g.output(drafts, "drafts", I64, ["B", k])
    g.output(step_ids, "step_ids", I64, ["B", 2 * k + 2])
    g.output(draft_probs, "draft_probs_out", F32, ["B", k, vocab])
    return g


def make_greedy_acceptance(g: GraphBuilder, ids: str, tokens: str, k: int) -> str:
    """accepted [B] int64: a = max{i <= k : d_1..d_i == g_0..g_{i-1}}, with d = ids[:, 1:] (the
    drafts) and g = tokens (the argmaxes): speculative.sampling.accept_lengths, in ONNX ops.

        d != g ─ Cast ─ CumSum (misses so far) ─ == 0 ─ Cast ─ ReduceSum      [B, k] -> [B]

    Only constants and inputs feed these ops, no shape-derived value (ONNX Runtime would place
    that on the CPU, and a CUDA graph may not hold CPU compute nodes)."""
    drafts = g.op("Slice", [ids, g.const([1]), g.const([k + 1]), g.const([1])])  # [B, k]: d_1..d_k
    targets = g.op("Slice", [tokens, g.const([0]), g.const([k]), g.const([1])])  # [B, k]: g_0..g_{k-1}
    missed = g.op("Cast", [g.op("Not", [g.op("Equal", [drafts, targets])])], to=I64)  # [B, k]: 1 where d_{i+1} != g_i
    misses = g.op("CumSum", [missed, g.const(1)])  # [B, k]: misses up to and including draft i+1
    kept = g.op("Cast", [g.op("Equal", [misses, g.const(0)])], to=I64)  # [B, k]: 1 before the first miss
    return g.op("ReduceSum", [kept, g.const([1])], keepdims=0, hint="accepted")  # [B]
