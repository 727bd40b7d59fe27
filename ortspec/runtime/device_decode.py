"""The target's plain decode (M=1) for a host that runs ahead of the GPU.

``TargetModel.decode`` downloads each step's argmax before it returns, so the host waits for
every step. ``DeviceDecode.step`` enqueues the same forward and the same state commit and
returns before the GPU is done (on CUDA the captured graph's Run does not synchronise):

    out = step(n, ids, positions)       forward + commit of step n; starts the copy of its tokens
                                        to the host (``streams.Readback``)
    ids, positions = feed(out, host)    step n+1's inputs: on the device, written into the captured
                                        slot's static inputs (step n's tokens; each position one
                                        on), so nothing is uploaded; else the tokens and `host`
    tokens(n)                           step n's tokens on the host [B]; waits for step n only
    hidden(n)                           (hidden=True) step n's hidden row [B, H] on the host, read
                                        back a step late like the tokens (auto k's MTP entries)

Same graph, slot key, feeds and commit as ``TargetModel.decode``, so the two are
interchangeable step by step, bit for bit (on CUDA the run's one KV window variant, fixed from
a bound on the positions it serves, ``kv_window.RunBound``, where the plain loop picks one per
step). One pipeline stage only: a stage boundary hands its proxies to another device through
copies that rely on each Run having finished. On the CPU it runs the same way over host arrays
(the tests check the pipelined loop's logic bitwise there).
"""

from __future__ import annotations

import numpy as np

from .graph_slots import SlotKey
from .kv_window import RunBound, attention_window
from .model import TargetModel
from .states import Rows
from .streams import StepReadbacks

GRAPH = "decode"


class DeviceDecode:
    """Decode steps over fixed batch ``rows`` of ``target``'s states, nothing downloaded.

    bound: where the run's running rows can reach (``kv_window.RunBound``); on CUDA the run's one
    graph is the decode's KV window variant past it. None: the portable graph (all max_length slots)."""

    def __init__(self, target: TargetModel, rows: Rows, hidden: bool = False, bound: RunBound | None = None) -> None:
        self.target, self.rows, self.graphs = target, rows, target.graphs
        self.arrays = self.graphs.arrays
        self.last_position = self.graphs.manifest.max_length - 1
        self.graph = GRAPH if bound is None else self.graphs.kv_windows.graph(GRAPH, bound.end(1, reach=1))
        self._key = SlotKey(self.graph, 1, len(rows), target.slot_id(rows))  # = SlotKey.for_run over ids [B, 1]
        self._readbacks = StepReadbacks(self.arrays, (len(rows), 1), np.int64)
        # hidden=True: the hidden rows [B, 1, H] read back too, made at step 0 (their dtype is the graph's)
        self._hidden_readbacks: StepReadbacks | None = None
        self._want_hidden = hidden
        self.hidden_dtype = None  # the hidden rows' dtype on the device, once step 0 ran
        self._outputs: list = [None, None]  # steps n-1 and n: an eager run's outputs live as long as this

    def step(self, n: int, ids, positions) -> dict:
        """Enqueues step n over ids and positions [B, 1] (host int64, or what ``feed`` made of step
        n-1), then the commit of every state; starts the copy of the step's tokens [B, 1] to the
        host. Returns the outputs where the backend keeps them."""
        feeds = {"input_ids": ids, "positions": positions,
                 **self.target.states.feeds(self.rows, attention_window(self.graphs, positions, reach=1))}
        out = self.graphs[self.graph].run(feeds, slot=self._key, wait=False)
        static = self.graphs.slots.static_input(self._key, "positions")  # uploaded there for this run
        self.target.states.advance(out, self.rows, positions if static is None else static)
        self._readbacks.start(n, out["tokens"])
        if self._want_hidden:
            self._start_hidden(n, out["hidden"])
        self._outputs[n % 2] = out
        return out

    def _start_hidden(self, n: int, hidden) -> None:
        """Starts the copy of step n's hidden rows [B, 1, H] to the host, behind the tokens' copy
        and before step n+1 is enqueued (a captured slot's output buffer is overwritten by it)."""
        if self._hidden_readbacks is None:
            self.hidden_dtype = hidden.dtype
            self._hidden_readbacks = StepReadbacks(self.arrays, hidden.shape, hidden.dtype)
        self._hidden_readbacks.start(n, hidden)

    def feed(self, out: dict, host_positions: np.ndarray) -> tuple:
        """(ids, positions) of the next step. With a captured slot: its static input_ids and
        positions, written on the device (this step's tokens; each position one on, as
        host_positions [B, 1] has them), so its replay uploads nothing. Without one (the CPU,
        CUDA without graphs): the tokens themselves and host_positions."""
        ids = self.graphs.slots.static_input(self._key, "input_ids")
        if ids is None:
            return out["tokens"], host_positions
        positions = self.graphs.slots.static_input(self._key, "positions")
        self.arrays.advance_decode_inputs(out["tokens"], ids, positions, self.last_position)
        return ids, positions

    def tokens(self, n: int) -> np.ndarray:
        """int64 [B]: the argmax of step n, once it is on the host."""
        return self._readbacks.wait(n)[:, 0]

    def hidden(self, n: int) -> np.ndarray:
        """[B, H] (hidden=True): step n's final-normed hidden rows once on the host, as
        ``arrays.download`` gives them (bfloat16: its uint16 bit pattern)."""
        return self._hidden_readbacks.wait(n)[:, 0]

    def close(self) -> None:
        """Frees the page-locked memory and events (under the device lock: freeing page-locked
        memory may synchronise the device, which no thread may do while another captures a graph)."""
        self._readbacks.close()
        if self._hidden_readbacks is not None:
            self._hidden_readbacks.close()
        self._outputs = [None, None]
