"""A run of plain decode steps (M=1) whose control stays on the device.

``TargetModel.decode`` downloads each step's argmax before it returns. A ``DecodeRun``
enqueues the same forward and the same state commit and returns at once (on CUDA the
captured graph's Run does not synchronise), so the loop may enqueue step n+1 before it reads
step n (depth 1) or read each step right after enqueueing it (depth 0):

    enqueue(0, ids, positions)   step 0 over host ids / positions [B, 1]
    enqueue(n)                   step n over step n-1's tokens, written on the device into the
                                 captured slot's static input (positions one on), nothing uploaded
    read(n)                      step n's tokens [B] (and hidden rows [B, H] with hidden=True,
                                 the MTP head's deferred entries), waiting for step n only

Same graph, slot key, feeds and commit as ``TargetModel.decode``, so the two are
interchangeable step by step, bit for bit (on CUDA the run's one KV window variant, fixed from
a bound on the positions it serves, ``kv_window.RunBound``). The device lock and the step's
scratch are taken here, not by the caller. One pipeline stage only (a stage boundary hands
its proxies over with copies that rely on each Run having finished). On the CPU it runs the
same way over host arrays, each Run over IOBinding (``TargetModel.bound_forward``): the GDN
states after a step are written into the spare buffers and flipped live, not copied.
"""

from __future__ import annotations

import numpy as np

from .graph_slots import SlotKey
from .kv_window import RunBound, attention_window
from .model import TargetModel
from .states import Rows

GRAPH, SAMPLED_GRAPH = "decode", "decode_sample"


class DecodeRun:
    """Decode steps over fixed batch ``rows`` of ``target``'s states (module docstring).

    bound: where the run's running rows can reach; on CUDA the run's one graph is the decode's
    KV window variant past it. None: the portable graph (all max_length slots). sampled: the
    graph that draws sampled rows' tokens on the device (``decode_sample``); each step is then
    given its sampling inputs (``runtime.sampling_inputs``: the rows' parameters and uniforms)."""

    host_binding = True  # the CPU's runs over IOBinding (False: the CUDA path, for its tests on the CPU)

    def __init__(self, target: TargetModel, rows: Rows, hidden: bool = False, bound: RunBound | None = None,
                 sampled: bool = False) -> None:
        self.target, self.rows, self.graphs = target, rows, target.graphs
        self.arrays = self.graphs.arrays
        self.last_position = self.graphs.manifest.max_length - 1
        graph = SAMPLED_GRAPH if sampled else GRAPH
        self.graph = graph if bound is None else self.graphs.kv_windows.graph(graph, bound.end(1, reach=1))
        self._key = SlotKey(self.graph, 1, len(rows), target.slot_id(rows))  # = SlotKey.for_run over ids [B, 1]
        self._bound = self.host_binding and self.arrays.device == "cpu"
        self._readbacks = target.step_readbacks("tokens", (len(rows), 1), np.int64)
        self._hidden_readbacks = None  # StepReadbacks, made at step 0 (the graph's dtype)
        self._want_hidden = hidden
        self.hidden_dtype = None  # the hidden rows' dtype on the device, once step 0 ran
        self._outputs: list = [None, None]  # steps n-1 and n: an eager run's outputs live as long as this
        self._positions: list = [None, None]  # steps n-1 and n's positions [B], kept as their outputs are
        self._read = -1  # the last step read

    def positions(self, n: int) -> np.ndarray:
        """[B]: step n's positions (a finished row's clamped inside the buffers), of the step
        enqueued last or the one before it."""
        return self._positions[n % 2]

    def enqueue(self, n: int, ids: np.ndarray | None = None, positions: np.ndarray | None = None,
                sampling: dict | None = None) -> None:
        """Enqueues step n (n = 0: over host ids / positions [B, 1]; later: fed on the device);
        sampling: a sampled run's inputs of this step (host arrays, uploaded with the replay)."""
        with self.graphs.device_lock:
            self.graphs.begin_step(check_errors=self._read == n - 1)  # waits only with nothing in flight
            if n == 0:
                self._positions[0] = np.asarray(positions, np.int64)[:, 0].copy()
            else:  # one on from step n-1's, as ints (a step's few rows: cheaper than numpy's arithmetic)
                last, before = self.last_position, self._positions[(n - 1) % 2].tolist()
                self._positions[n % 2] = np.array([min(t + 1, last) for t in before], np.int64)
                ids, positions = self._feed(self._outputs[(n - 1) % 2], self._positions[n % 2][:, None])
            if self._bound:  # the CPU: states bound where they live, the GDN states after it in the spares
                out = self.target.bound_forward(self.graph, self.rows,
                                                {"input_ids": ids, "positions": positions, **(sampling or {})})
                self.target.states.flip(self.rows, positions, out)
            else:
                feeds = {"input_ids": ids, "positions": positions, **(sampling or {}),
                         **self.target.states.feeds(self.rows, attention_window(self.graphs, positions, reach=1))}
                out = self.graphs[self.graph].run(feeds, slot=self._key, wait=False)
                static = self.graphs.slots.static_input(self._key, "positions")  # uploaded there for this run
                self.target.states.advance(out, self.rows, positions if static is None else static)
            self._readbacks.start(n, out["tokens"])
            if self._want_hidden:
                self._start_hidden(n, out["hidden"])
            self._outputs[n % 2] = out

    def _start_hidden(self, n: int, hidden) -> None:
        """Starts the copy of step n's hidden rows [B, 1, H] to the host, before step n+1 is
        enqueued (a captured slot's output buffer is overwritten by it)."""
        if self._hidden_readbacks is None:
            self.hidden_dtype = hidden.dtype
            self._hidden_readbacks = self.target.step_readbacks("hidden", hidden.shape, hidden.dtype)
        self._hidden_readbacks.start(n, hidden)

    def _feed(self, out: dict, host_positions: np.ndarray) -> tuple:
        """(ids, positions) of the next step. With a captured slot: its static input_ids and
        positions, written on the device (this step's tokens; each position one on), so its
        replay uploads nothing. Without one (the CPU, CUDA without graphs): the tokens
        themselves and host_positions [B, 1]."""
        ids = self.graphs.slots.static_input(self._key, "input_ids")
        if ids is None:
            return out["tokens"], host_positions
        positions = self.graphs.slots.static_input(self._key, "positions")
        self.arrays.advance_decode_inputs(out["tokens"], ids, positions, self.last_position)
        return ids, positions

    def read(self, n: int) -> tuple[np.ndarray, np.ndarray | None]:
        """(tokens int64 [B], hidden [B, H] or None): step n's, once on the host (hidden as
        ``arrays.download`` gives it: bfloat16 as its uint16 bit pattern)."""
        tokens = self._readbacks.wait(n)[:, 0]
        hidden = self._hidden_readbacks.wait(n)[:, 0] if self._want_hidden else None
        self._read = n
        return tokens, hidden

    def close(self) -> None:
        """Waits for a step run past the last read and reports any index error a kernel recorded
        (the page-locked copies stay with the model for the next run)."""
        with self.graphs.device_lock:
            try:
                self.graphs.begin_step()
            finally:
                self._outputs = [None, None]
