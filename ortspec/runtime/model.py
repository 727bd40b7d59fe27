"""One forward at a time: the target model and the MTP head over a batch of state rows.

This layer owns sessions, feeds and states; it makes no decision about which tokens to
run (that is the speculative layer's job). Every method takes the batch rows it runs on
and [B, M] ids/positions built by the caller, and returns the graph outputs.
"""

from __future__ import annotations

import numpy as np

from ..manifest import Manifest, graph_name
from .graphs import GraphSet
from .states import Rows, Snapshot, StateSet


class TargetModel:
    """The hybrid target: prefill, M=1 decode, M=k+1 verify (plain or with state windows)."""

    def __init__(self, graphs: GraphSet, batch: int) -> None:
        self.graphs = graphs
        self.states = StateSet(graphs.manifest.states, batch, ("kv_key", "conv", "recurrent"))

    def _run(self, name: str, rows: Rows, ids: np.ndarray, positions: np.ndarray) -> dict:
        feeds = {"input_ids": ids, "positions": positions, **self.states.feeds(rows)}
        return self.graphs[name].run(feeds)

    def prefill(self, rows: Rows, ids: np.ndarray, positions: np.ndarray) -> dict:
        out = self._run("prefill", rows, ids, positions)
        self.states.advance(out, rows, positions)
        return out

    def decode(self, rows: Rows, ids: np.ndarray, positions: np.ndarray) -> dict:
        """ids/positions [B, 1]."""
        out = self._run("decode", rows, ids, positions)
        self.states.advance(out, rows, positions)
        return out

    def verify(self, rows: Rows, ids: np.ndarray, positions: np.ndarray) -> dict:
        """ids/positions [B, k+1]; advances every state past all k+1 rows (readvance fixes it)."""
        out = self._run(graph_name("verify", ids.shape[1] - 1), rows, ids, positions)
        self.states.advance(out, rows, positions)
        return out

    def verify_windows(self, rows: Rows, ids: np.ndarray, positions: np.ndarray) -> dict:
        """Like verify, but leaves the states untouched; the outputs hold the state after each row."""
        return self._run(graph_name("verify_select", ids.shape[1] - 1), rows, ids, positions)

    def select(self, out: dict, rows: Rows, positions: np.ndarray, accepted: np.ndarray) -> None:
        self.states.select(out, rows, positions, accepted)

    def snapshot(self, rows: Rows, lengths: np.ndarray) -> Snapshot:
        return self.states.snapshot(rows, lengths)

    def restore(self, snap: Snapshot, rows: Rows, lengths: np.ndarray) -> None:
        self.states.restore(snap, rows, lengths)


class MTPHead:
    """The MTP draft head with its own KV cache.

    Entry p of its cache holds (h_p, x_{p+1}): the target's final-normed hidden state at
    position p and the token that followed. ``catch_up`` fills entries from target hiddens
    (after prefill and after every commit); ``draft`` runs one recursive step on the head's
    own output hidden, writing a speculative entry that the next catch-up overwrites.
    """

    def __init__(self, graphs: GraphSet, batch: int) -> None:
        self.graphs = graphs
        self.states = StateSet(graphs.manifest.states, batch, ("mtp_kv_key",))

    def run(self, rows: Rows, ids: np.ndarray, hidden: np.ndarray, positions: np.ndarray,
            counts: np.ndarray | None = None) -> dict:
        """ids/positions [B, M], hidden [B, M, H]; writes the first counts[j] entries of row j."""
        feeds = {"input_ids": ids, "hidden": hidden, "positions": positions, **self.states.feeds(rows)}
        out = self.graphs["mtp"].run(feeds)
        for kind in self.states.kinds:
            kind.write(out, rows, positions, counts)
        return out
