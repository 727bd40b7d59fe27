"""The sampling transform and an inverse-CDF draw in ONNX, for the MTP head's sampled drafts.

The draft passes are chained inside one graph (draft j+1 is the input of pass j+2), so a
sampled draft must be drawn inside it. These are the steps of ``speculative.sampling.transform``
and ``draw`` (the numpy versions the target's tokens use), op for op in float32:

    z = logits / T ─ TopK(V, sorted) ─ top-k mask ─ softmax ─ CumSum ─ top-p mask ─┐
    threshold = the smallest kept sorted value  <──────────────────────────────────┘
    probs = Softmax(z where z >= threshold, else -inf)
    token = #{cdf <= u · total}, never past the last token of positive probability

Rows with T = 0 (greedy requests in a batch that samples) run the transform at T = 1; their
draft is the argmax and their probabilities are not used.
"""

from __future__ import annotations

from onnx import TensorProto

from .builder import GraphBuilder

BOOL, I64 = TensorProto.BOOL, TensorProto.INT64


def per_row(g: GraphBuilder, value: str) -> str:
    """[B] -> [B, 1, 1], to broadcast over [B, 1, V]."""
    return g.op("Unsqueeze", [value, g.const([1, 2])])


def make_sampling_probs(g: GraphBuilder, logits: str, temperature: str, top_k: str, top_p: str, vocab: int) -> str:
    """logits [B, 1, V] and per-request temperature, top_k (0: off), top_p (1: off) [B] -> probs [B, 1, V]."""
    t = per_row(g, temperature)
    z = g.op("Div", [logits, g.op("Where", [g.op("Greater", [t, g.const(0.0, "float32")]), t,
                                            g.const(1.0, "float32")])])  # [B, 1, V]
    ordered, _ = g.op("TopK", [z, g.const([vocab])], num_outputs=2, axis=-1, largest=1, sorted=1)  # descending
    k = per_row(g, top_k)
    kept_by_k = g.op("Where", [g.op("Greater", [k, g.const(0)]), g.op("Min", [k, g.const(vocab)]), g.const(vocab)])
    rank = g.const(range(vocab), hint="rank")  # [V]
    in_k = g.op("Less", [rank, kept_by_k])  # [B, 1, V]
    ordered_k = g.op("Where", [in_k, ordered, g.const(float("-inf"), "float32")])
    mass = g.op("Softmax", [ordered_k], axis=-1)
    before = g.op("Sub", [g.op("CumSum", [mass, g.const(-1)]), mass])  # mass ahead of each rank
    p = per_row(g, top_p)
    within_p = g.op("Or", [g.op("Less", [before, p]), g.op("GreaterOrEqual", [p, g.const(1.0, "float32")])])
    kept = g.op("Cast", [g.op("And", [in_k, within_p])], to=I64)
    count = g.op("ReduceSum", [kept, g.const([-1])], keepdims=1)  # [B, 1, 1]
    threshold = g.op("GatherElements", [ordered, g.op("Sub", [count, g.const(1)])], axis=-1)  # [B, 1, 1]
    masked = g.op("Where", [g.op("GreaterOrEqual", [z, threshold]), z, g.const(float("-inf"), "float32")])
    return g.op("Softmax", [masked], axis=-1, hint="draft_probs")


def make_draw(g: GraphBuilder, probs: str, u: str, vocab: int) -> str:
    """probs [B, 1, V], uniforms u [B, 1] in [0, 1) -> tokens int64 [B, 1] (inverse CDF)."""
    cdf = g.op("CumSum", [probs, g.const(-1)])  # [B, 1, V]
    total = g.op("Slice", [cdf, g.const([vocab - 1]), g.const([vocab]), g.const([-1])])  # [B, 1, 1]
    target = g.op("Mul", [g.op("Unsqueeze", [u, g.const([2])]), total])
    below = g.op("ReduceSum", [g.op("Cast", [g.op("LessOrEqual", [cdf, target])], to=I64), g.const([-1])],
                 keepdims=0)  # [B, 1]
    positive_rank = g.op("Where", [g.op("Greater", [probs, g.const(0.0, "float32")]), g.const(range(vocab)),
                                   g.const(0)])
    last_positive = g.op("ReduceMax", [positive_rank, g.const([-1])], keepdims=0)  # [B, 1]
    return g.op("Min", [below, last_positive])


def make_draft_choice(g: GraphBuilder, logits: str, temperature: str, top_k: str, top_p: str, u: str,
                      vocab: int) -> tuple[str, str]:
    """One draft per request from its head's logits [B, 1, V]: drawn where temperature > 0, else
    the argmax. Returns (tokens int64 [B, 1], probs [B, 1, V] the draw came from)."""
    probs = make_sampling_probs(g, logits, temperature, top_k, top_p, vocab)
    sampled = make_draw(g, probs, u, vocab)
    greedy = g.op("ArgMax", [logits], axis=-1, keepdims=0)  # [B, 1]
    samples = g.op("Unsqueeze", [g.op("Greater", [temperature, g.const(0.0, "float32")]), g.const([1])])  # [B, 1]
    return g.op("Where", [samples, sampled, greedy]), probs
