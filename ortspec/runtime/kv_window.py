"""Which KV slots a forward attends over: the first W of the caches' max_length, W past every
position the forward serves. The slots past a row's position are masked (they add exact
zeros), so they cost time, not bits; each provider narrows them its own way:

- CPU (``KVWindows.views``): the graph gets the first ``window_slots`` slots, a multiple of
  WINDOW_STEP (the shapes are free: nothing is captured); the host caches hold just the slots
  the forwards need, so that window is their rows, read in place (``states.KVCache.fit``).
- CUDA (``KVWindows.variants``): a captured graph keeps its shapes and binds the full cache
  buffers, so the runtime runs the graph's window variant (converter/kv_windows.py), the
  smallest W of its buckets (256, 512, ...) past the positions, or the portable graph (all
  max_length slots) past every bucket. The plain loop picks per forward from the positions it
  runs; a run of steps fed on the device (``runtime.decode_run``, ``fused_run``) does not
  know them on the host and fixes one graph per run from a ``RunBound``.

A forward over positions up to p that reaches ``reach`` slots past p needs slots [0, p + reach):
reach 1 for the target (its own row), k for the MTP head drafting k tokens (the draft passes sit
up to k-1 slots past the last row).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..manifest import Manifest, window_graph_name

WINDOW_STEP = 64  # CPU KV window sizes are multiples of this, so a run sees few distinct shapes


def window_slots(max_length: int, last_position: int, reach: int) -> int:
    """The first multiple of WINDOW_STEP at or past last_position + reach, at most max_length."""
    return min(max_length, -(-(last_position + reach) // WINDOW_STEP) * WINDOW_STEP)


def attention_window(graphs, positions: np.ndarray, reach: int) -> int | None:
    """The first W KV slots of the caches a forward over positions [B, M] is fed (CPU views,
    ``window_slots``); None: the whole buffers (CUDA, whose graphs narrow them themselves where they
    have variants; graphs converted without windows)."""
    if not graphs.kv_windows.views:
        return None
    last = max(map(max, positions.tolist()))  # as ints: for a step's few, cheaper than a numpy reduction
    return window_slots(graphs.manifest.max_length, last, reach)


class KVWindows:
    """How forwards of one GraphSet narrow the KV caches: views on the CPU (graphs converted with
    ``attention_window``), variants on CUDA (graphs converted with window variants). ``variants``
    may be set on the CPU too (tests run the CUDA choice there); then views are off."""

    def __init__(self, manifest: Manifest, variants: bool, host_buffers: bool | None = None) -> None:
        """host_buffers: whether the caches are host arrays, which views can narrow (default: on
        the CPU, i.e. where variants are off); device buffers cannot be viewed, so turning variants
        off on CUDA (tools/gpu.py kv_windows) runs the portable graphs over whole buffers."""
        self.manifest, self.variants = manifest, variants
        self.host_buffers = not variants if host_buffers is None else host_buffers

    @property
    def views(self) -> bool:
        return self.host_buffers and not self.variants and self.manifest.attention_window

    def bucket(self, graph: str, end: int) -> int | None:
        """The smallest window W >= end among ``graph``'s variants; None: the portable graph."""
        return next((w for w in self.manifest.window_buckets(graph) if w >= end), None)

    def graph(self, graph: str, end: int) -> str:
        """The graph to run for a forward that needs slots [0, end): its window variant on CUDA
        (``bucket``), else ``graph`` itself (the CPU; past every bucket; graphs without variants)."""
        slots = self.bucket(graph, end) if self.variants else None
        return graph if slots is None else window_graph_name(graph, slots)

    def for_positions(self, graph: str, positions: np.ndarray, reach: int) -> str:
        """``graph`` for a forward over host positions [B, M] reaching ``reach`` past them."""
        return self.graph(graph, int(positions.max()) + reach) if self.variants else graph


@dataclasses.dataclass(frozen=True)
class RunBound:
    """The last first position a run of steps (one step ahead of the GPU) can step a running row
    from. A step emits tokens, and positions advance by exactly the tokens a step emits; a row
    runs while it has tokens left (max_new_tokens - output_length). So a row starting the run at
    T_j with t_j tokens left starts every step it runs at most at T_j + t_j - 1: its last step
    emits its last token. Rows that finish (a budget, a stop token) keep running on CUDA past
    that, but their results are dropped, so they need not fit: a window variant keeps them inside
    its slots (converter/kv_windows.py)."""

    last_first: int  # max over running rows of T_j + t_j - 1 (-1: no running row)

    @classmethod
    def of(cls, requests) -> "RunBound":
        """From the run's requests as it starts (``speculative.requests.Request``: processed = T,
        output_length, max_new_tokens, done)."""
        return cls(max((r.processed + r.max_new_tokens - r.output_length - 1 for r in requests if not r.done),
                       default=-1))

    @classmethod
    def one_step(cls, requests) -> "RunBound":
        """A run of one step (its inputs come from the host every step): its running rows' positions."""
        return cls(max((r.processed for r in requests if not r.done), default=-1))

    def end(self, tokens_per_step: int, reach: int) -> int:
        """Slots [0, end) hold every position a running row's step touches: a step of M tokens from
        T writes T..T+M-1 and reaches ``reach`` slots past T+M-1 (the MTP head's drafts: k)."""
        return self.last_first + tokens_per_step - 1 + reach
