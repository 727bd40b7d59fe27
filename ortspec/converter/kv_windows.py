"""KV window variants: CUDA graphs that attend over the first W slots of the caches, not all L.

On the CPU the runtime hands a graph views of the first W KV slots (``runtime/kv_window.py``),
a multiple of 64 past the call's last position: masked slots add exact zeros, so the bits do
not depend on W, and the attention costs what the used slots cost. A captured CUDA graph
cannot do that: it binds fixed shapes at fixed addresses, and a key window [B, kvh, hd, :W]
of the cache [B, kvh, hd, L] is not contiguous. So without variants every step on CUDA
scatters its rows into a copy of all L slots per layer and runs the score/context products
and the softmax over L (measured on the H200: the same bench converted at max_length 256
instead of 1024 ran greedy 8.6% faster on the 20M model; BENCHMARKS.md).

A window variant of a graph, for each W of ``window_buckets(max_length)``, is that graph built for
W slots (the draft positions clamped to W-1, as the portable graph clamps them to L-1), fed
the same full cache buffers (the same device addresses every step, as captured graphs need):

    key.i [B, kvh, hd, L] ─ Slice(axis 3, 0:W) ─┐
    value.i [B, kvh, L, hd] ─ Slice(axis 2, 0:W) ┼─ the graph over W slots (bias, scatter, products)
    positions [B, M] ─ Min(W-1) ─────────────────┘

The runtime picks the smallest W past every running row's positions; rows it need not serve
(a finished request's row keeps running on CUDA, its results dropped) may sit past W, and the
Min keeps their scatter indices inside the window. For every position below W the Min is
the identity, so a served row computes what the portable graph computes over its first W
slots. The runtime writes the new KV rows into the full buffers at the real positions, as
for the portable graph.

Variants are built for the graphs a CUDA Session captures and that attend: decode and
decode_sample, the verify graphs, the fused verify_mtp (and verify_mtp_sample) graphs and the MTP head's (not prefill, which runs any
length eagerly; not pipeline stages; not the one-pass ``mtp`` graph, which no Session runs).
"""

from __future__ import annotations

from .builder import GraphBuilder

WINDOW_BUCKETS_FROM = 256  # the smallest window; each next one doubles, up to (not including) max_length
KV_SLOT_AXIS = {"key": 3, "value": 2}  # key [B, kvh, hd, L] (transposed), value [B, kvh, L, hd]
WINDOWED_PER_K = ("verify_k", "verify_select_k", "verify_mtp_k", "verify_mtp_sample_k", "verify_mtp_tempered_k",
                  "mtp_propose_k", "mtp_sample_k")  # and decode, decode_sample, decode_tempered


def window_buckets(max_length: int) -> list[int]:
    """The windows W a conversion at max_length builds variants for: 256, 512, ... below max_length
    (the portable graph is W = max_length); none at max_length <= 256."""
    buckets, slots = [], WINDOW_BUCKETS_FROM
    while slots < max_length:
        buckets.append(slots)
        slots *= 2
    return buckets


def has_window_variants(name: str) -> bool:
    """Whether graph ``name`` gets window variants (module docstring: captured on CUDA, attends;
    a pipeline stage, decode.stage0, does not)."""
    return "." not in name and (name in ("decode", "decode_sample", "decode_tempered") or name.startswith(WINDOWED_PER_K))


def narrow_to_window(g: GraphBuilder, slots: int, max_length: int) -> GraphBuilder:
    """Turns a finished graph built for ``slots`` KV slots into its window variant (module
    docstring): each KV cache input is declared at max_length and Sliced to its first ``slots``
    inside the graph, the positions are clamped to slots - 1; every node that read an input reads
    the narrowed value. Returns g."""
    narrowed = {}
    for value_info in g.inputs:
        name, kind = value_info.name, value_info.name.split(".")[0]
        if kind in KV_SLOT_AXIS:
            axis = KV_SLOT_AXIS[kind]
            value_info.type.tensor_type.shape.dim[axis].dim_value = max_length  # [.., L, ..]: the whole buffer
            narrowed[name] = g.op("Slice", [name, g.const([0]), g.const([slots]), g.const([axis])],
                                  hint=f"{name}.window")  # the first `slots` slots
        elif name == "positions":
            narrowed[name] = g.op("Min", [name, g.const(slots - 1)], hint="positions.window")  # [B, M]
    added = g.nodes[len(g.nodes) - len(narrowed):]
    body = g.nodes[: len(g.nodes) - len(narrowed)]
    for node in body:
        node.input[:] = [narrowed.get(i, i) for i in node.input]
    g.nodes[:] = added + body  # topological order: the narrowed values first
    return g

