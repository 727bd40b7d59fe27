"""GPU time per step of one graph and its commit, as a loop that runs ahead of the GPU sees it.

A step is one fixed-shape Run of a target graph (decode, or verify_select_k{k}) replayed as a CUDA
graph, then its state commit (``StateSet.advance`` for the decode, ``StateSet.select`` with
device-side accept lengths for a verify), enqueued on the shared stream without a wait. After a
warm-up (the slot's eager run, its capture, a replay), ``steps`` steps are enqueued back to back,
their inputs the slot's static buffers (nothing uploaded), then one wait: wall time over steps is
the GPU time per step while the host keeps ahead. Every step runs at the same positions (the
commit rewrites the same KV slots; the GDN states move on, bounded: g <= 0, |k̂| = 1, β < 1).
On the CPU (tests) the same calls run synchronously.
"""

from __future__ import annotations

import time

import numpy as np

from ortspec.manifest import graph_name
from ortspec.runtime.graph_slots import SlotKey
from ortspec.runtime.kv_window import attention_window
from ortspec.runtime.model import TargetModel
from ortspec.runtime.states import Rows

POSITION = 32  # the first position every timed step runs at
WARM_UP = 3  # the slot's eager run, its capture (ONNX Runtime runs it twice more), a first replay


class StepTimer:
    """Timed steps over one batch size of one GraphSet (its own TargetModel: one engine)."""

    def __init__(self, graphs, batch: int) -> None:
        self.graphs, self.arrays = graphs, graphs.arrays
        self.target = TargetModel(graphs, batch)
        self.rows = Rows(range(batch))
        self.batch = batch

    def decode_ms(self, steps: int) -> float:
        return self._time("decode", 1, steps, lambda out, positions: self.target.states.advance(out, self.rows, positions))

    def verify_ms(self, k: int, steps: int, accepted: int | None = None) -> float:
        """verify_select_k{k} and its select commit of accepted drafts (default k: every row, the
        most a transition commit replays), the accept lengths and counts in device buffers."""
        accepted = k if accepted is None else accepted
        lengths = self._device(np.full(self.batch, accepted, np.int64))  # [B]
        counts = self._device(np.full(self.batch, accepted + 1, np.int64))  # [B]

        def commit(out, positions):
            self.target.states.select(out, self.rows, positions, lengths, counts=counts)

        return self._time(graph_name("verify_select", k), k + 1, steps, commit)

    def _device(self, host: np.ndarray):
        buffer = self.arrays.zeros(host.shape, host.dtype)
        self.arrays.upload(buffer, host)
        return buffer

    def _time(self, name: str, rows: int, steps: int, commit) -> float:
        """ms per step of graph ``name`` over [B, rows] ids and its commit."""
        ids = np.full((self.batch, rows), 7, np.int64)  # [B, M]
        positions = np.broadcast_to(np.arange(POSITION, POSITION + rows), ids.shape).copy()  # [B, M]
        graph = self.graphs.kv_windows.for_positions(name, positions, reach=1)
        key = SlotKey.for_run(graph, ids, self.target.slot_id(self.rows))
        window = attention_window(self.graphs, positions, reach=1)

        def step(step_ids, step_positions) -> None:
            self.graphs.begin_step(check_errors=False)
            feeds = {"input_ids": step_ids, "positions": step_positions, **self.target.states.feeds(self.rows, window)}
            commit(self.graphs[graph].run(feeds, slot=key, wait=False), step_positions)

        for _ in range(WARM_UP):
            step(ids, positions)
        static = [self.graphs.slots.static_input(key, n) for n in ("input_ids", "positions")]
        if all(buffer is not None for buffer in static):  # a captured slot: feed its own buffers, upload nothing
            ids, positions = static
        self.arrays.synchronize()
        self.graphs.begin_step()  # reports any index error a kernel recorded so far
        start = time.perf_counter()
        for _ in range(steps):
            step(ids, positions)
        self.arrays.synchronize()
        elapsed = time.perf_counter() - start
        self.graphs.begin_step()
        return 1000 * elapsed / steps
