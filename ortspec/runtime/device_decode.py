"""The target's plain decode (M=1) for a host that runs ahead of the GPU.

``TargetModel.decode`` downloads each step's argmax before it returns, so the host waits for
every step. ``DeviceDecode.step`` enqueues the same forward and the same state commit and
returns before the GPU is done (on CUDA the captured graph's Run does not synchronise):

    out = step(n, ids, positions)   forward + commit of step n; starts the copy of its tokens
                                    to the host (``streams.Readback``)
    ids = feed(out)                 step n's tokens as step n+1's input_ids, on the device: copied
                                    into the captured slot's static input, so nothing is uploaded
    tokens(n)                       step n's tokens on the host [B]; waits for step n only

Same graph, slot key, feeds and commit as ``TargetModel.decode``, so the two are
interchangeable step by step, bit for bit. One pipeline stage only: a stage boundary hands its
proxies to another device through copies that rely on each Run having finished. On the CPU it
runs the same way over host arrays (the tests check the pipelined loop's logic bitwise there).
"""

from __future__ import annotations

import numpy as np

from .graph_slots import SlotKey
from .model import TargetModel, attention_window
from .states import Rows

GRAPH = "decode"


class DeviceDecode:
    """Decode steps over fixed batch ``rows`` of ``target``'s states, nothing downloaded."""

    def __init__(self, target: TargetModel, rows: Rows) -> None:
        self.target, self.rows, self.graphs = target, rows, target.graphs
        self.arrays = self.graphs.arrays
        self._key = SlotKey(GRAPH, 1, len(rows), target.slot_id(rows))  # = SlotKey.for_run over ids [B, 1]
        self._readbacks = [self.arrays.readback((len(rows), 1), np.int64) for _ in range(2)]
        self._outputs: list = [None, None]  # steps n-1 and n: an eager run's outputs live as long as this

    def step(self, n: int, ids, positions: np.ndarray) -> dict:
        """Enqueues step n over ids [B, 1] (host int64, or ``feed`` of step n-1) at positions
        [B, 1] (host int64), then the commit of every state; starts the copy of the step's
        tokens [B, 1] to the host. Returns the outputs where the backend keeps them."""
        feeds = {"input_ids": ids, "positions": positions,
                 **self.target.states.feeds(self.rows, attention_window(self.graphs, positions, reach=1))}
        out = self.graphs[GRAPH].run(feeds, slot=self._key, wait=False)
        static = self.graphs.slots.static_input(self._key, "positions")  # uploaded there for this run
        self.target.states.advance(out, self.rows, positions if static is None else static)
        self._readbacks[n % 2].start(out["tokens"])
        self._outputs[n % 2] = out
        return out

    def feed(self, out: dict):
        """The next step's input_ids from this step's tokens, without the host: copied on the
        device into the captured slot's static input_ids; where no slot is captured (the CPU,
        CUDA without graphs) the tokens themselves."""
        static = self.graphs.slots.static_input(self._key, "input_ids")
        if static is None:
            return out["tokens"]
        self.arrays.copy(static, out["tokens"])
        return static

    def tokens(self, n: int) -> np.ndarray:
        """int64 [B]: the argmax of step n, once it is on the host."""
        return self._readbacks[n % 2].wait()[:, 0]

    def close(self) -> None:
        """Frees the page-locked memory and events (under the device lock: freeing page-locked
        memory may synchronise the device, which no thread may do while another captures a graph)."""
        self._readbacks, self._outputs = [], [None, None]
