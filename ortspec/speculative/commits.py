"""How a speculative step verifies and commits: one object per strategy, chosen once per Decoder.

A strategy answers the two verbs the step calls, in this order:

    verify(batch, ids, positions) -> Verified        the target over [x_T, d1..dk] at T..T+k
    commit(batch, verified, accepted, stats)         every target state to T + a + 1 tokens

``SelectCommit``: the windowed verify leaves every state untouched and emits the state after
each row; the commit keeps row a's (KV rows 0..a, GDN window slot a). One forward per step.
``ReadvanceCommit``: snapshot the GDN states, verify with the plain graph (states advance past
all k+1 rows), and where a row rejected a draft, restore and re-run its accepted tokens one
at a time. Needs no windowed graph; costs up to k extra forwards per step.

Both run their forwards through the Decoder's forward shapes (``runtime.forward_shapes``), so
in exact mode every forward, readvance's re-runs included, is the one fixed-shape forward.
The MTP head's catch-up is the same for both and stays in the step.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..runtime.forward_shapes import FixedShape, ShapePerCall
from ..runtime.model import Forward
from ..runtime.states import Snapshot
from .requests import Batch
from .stats import Stats


@dataclasses.dataclass
class Verified:
    """A verify forward, as its strategy needs it again at commit time."""

    out: Forward  # tokens [B, W] (W = k+1, or K_fix+1 in exact mode), hidden [B, W, H], positions [B, W];
    #               valid until the next target forward (on CUDA its slot's static buffers)
    ids: np.ndarray  # int64 [B, k+1]: x_T, d1..dk
    positions: np.ndarray  # int64 [B, k+1]: T..T+k
    snapshot: Snapshot | None = None  # readvance: the GDN states before the verify


class SelectCommit:
    """Verify with state windows; commit slot a."""

    name, verify_graph = "select", "verify_select"

    def __init__(self, forwards: ShapePerCall | FixedShape) -> None:
        self.forwards = forwards

    def verify(self, batch: Batch, ids: np.ndarray, positions: np.ndarray) -> Verified:
        return Verified(self.forwards.windows(batch.rows, ids, positions), ids, positions)

    def commit(self, batch: Batch, verified: Verified, accepted: np.ndarray, stats: Stats) -> None:
        self.forwards.select(verified.out, batch.rows, accepted)


class ReadvanceCommit:
    """Snapshot, verify advancing every state; restore and re-run where a draft was rejected."""

    name, verify_graph = "readvance", "verify"

    def __init__(self, forwards: ShapePerCall | FixedShape) -> None:
        self.forwards, self.target = forwards, forwards.target

    def verify(self, batch: Batch, ids: np.ndarray, positions: np.ndarray) -> Verified:
        snapshot = self.target.snapshot(batch.rows, batch.processed)
        return Verified(self.forwards.advance(batch.rows, ids, positions), ids, positions, snapshot)

    def commit(self, batch: Batch, verified: Verified, accepted: np.ndarray, stats: Stats) -> None:
        """If a row rejected a draft: restore the pre-verify state and re-run the accepted
        tokens one at a time, keeping each row's state after its own a+1 tokens; rows that
        accepted everything keep the verify's state. All rows run together (on CUDA the rows
        are fixed), so the states after each re-run are recorded and every row selects its
        own. Full acceptance of all rows re-runs nothing."""
        ids, positions, k = verified.ids, verified.positions, verified.ids.shape[1] - 1
        partial = accepted < k
        if not partial.any():
            return
        states, rows = self.target.states, batch.rows
        last = int(accepted[partial].max())
        recorded = [None] * (last + 1) + [states.capture(rows)]  # slot last+1: the verify's own state
        self.target.restore(verified.snapshot, rows, batch.processed)
        for i in range(last + 1):
            self.forwards.advance(rows, ids[:, i: i + 1], positions[:, i: i + 1])
            recorded[i] = states.capture(rows)
        stats.readvance_forwards += last + 1
        states.select_captured(recorded, np.where(partial, accepted, last + 1), rows)


COMMITS = {strategy.name: strategy for strategy in (SelectCommit, ReadvanceCommit)}
