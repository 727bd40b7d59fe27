"""A run of fused speculative steps (``verify_mtp_k{k}``: verify, acceptance and the MTP head in
one Run) whose control stays on the device.

``TargetModel.verify_with_head`` downloads each step's step_ids before it returns, and the host
then works out the commit and the next step's inputs. Everything a step's control needs can be
made on the device from the step_ids [B, 2k+2] (e_0..e_k | a | d_1..d_k: the emitted tokens,
the accept length, the head's next drafts) the graph wrote, so a ``FusedRun`` enqueues a step
and returns before the GPU is done:

    enqueue(0, ids, positions)   the Run of step 0 over host ids / positions [B, k+1]
    enqueue(n)                   the Run of step n over the inputs step n-1 made on the device;
                                 then one kernel (``advance_speculative_inputs``): counts = a + 1
                                 and the positions just verified (for the commit), then the next
                                 step's ids [e_a, d_1..d_k] and positions T + a + 1 + 0..k in
                                 place; then the commit (GDN window slot a, target KV and MTP
                                 entries 0..a, reading a where the kernel wrote it); then the
                                 copy of step_ids to the host
    read(n)                      step n's step_ids [B, 2k+2] on the host, waiting for step n only

The inputs the next Run reads are the captured slot's static input_ids / positions (a replay
uploads nothing), or without a captured slot (the CPU, CUDA without graphs) buffers of this
object's own. On CUDA the run's one KV window variant is fixed from a ``kv_window.RunBound``;
on the CPU its Runs go over IOBinding (``TargetModel.bound_forward``).
A finished row keeps running: its positions stop at ``last_start`` = max_length - k - 1,
where k+1 positions still fit. The device lock and the step's scratch are taken here.
"""

from __future__ import annotations

import numpy as np

from ..manifest import graph_name
from .graph_slots import SlotKey
from .kv_window import RunBound, attention_window
from .model import MTPHead, TargetModel
from .states import Rows


class FusedRun:
    """Fused speculative steps of k drafts over fixed batch ``rows`` (module docstring).

    bound: where the run's running rows can reach; on CUDA the run's one graph is the KV window
    variant past it, with the head's drafts (k slots past a step's last position). None: the
    portable graph (all max_length slots)."""

    host_binding = True  # the CPU's runs over IOBinding (False: the CUDA path, for its tests on the CPU)

    def __init__(self, target: TargetModel, mtp: MTPHead, rows: Rows, k: int, bound: RunBound | None = None,
                 sampled: bool = False) -> None:
        self.target, self.mtp, self.rows, self.k = target, mtp, rows, k
        self.graphs = target.graphs
        self.arrays = self.graphs.arrays
        self.sampled = sampled  # verify_mtp_sample_k{k}: sampled rows accepted and drafted on the device
        self.graph = graph_name("verify_mtp_sample" if sampled else "verify_mtp", k)
        if bound is not None:
            self.graph = self.graphs.kv_windows.graph(self.graph, bound.end(k + 1, reach=k))
        self.last_start = self.graphs.manifest.max_length - (k + 1)
        self._key = SlotKey(self.graph, k + 1, len(rows), target.slot_id(rows))  # = SlotKey.for_run over ids [B, k+1]
        shape = (len(rows), k + 1)
        self._own = {name: target.control_buffer(name, rows, shape) for name in ("input_ids", "positions")}
        self._verified = target.control_buffer("verified", rows, shape)  # [B, k+1]: the positions a step commits at
        self._counts = target.control_buffer("counts", rows, (len(rows),))  # [B]: a + 1
        self._readbacks = target.step_readbacks("step_ids", (len(rows), 2 * k + 2), np.int64)
        self._outputs: list = [None, None]  # steps n-1 and n: an eager run's outputs live as long as this
        self._read = -1  # the last step read
        self._bound = self.host_binding and self.arrays.device == "cpu"

    def enqueue(self, n: int, ids: np.ndarray | None = None, positions: np.ndarray | None = None,
                sampling: dict | None = None) -> None:
        """Enqueues step n (n = 0: over host ids / positions [B, k+1]; later: the device's), the
        kernel that makes the commit's counts and the next step's inputs, and the commit. A sampled
        run's step takes its sampling inputs (host arrays) and the distributions its drafts were
        drawn from (``draft_probs``, on the device), and leaves its next drafts' there."""
        with self.graphs.device_lock:
            self.graphs.begin_step(check_errors=self._read == n - 1)  # waits only with nothing in flight
            if n > 0:
                ids, positions = self.inputs()
            out = self._bound_run(ids, positions, sampling) if self._bound else self._run(ids, positions, sampling)
            if self.sampled:  # [B, k, V]: the next step's q, where its Run reads it
                self.rows.put(self.arrays, self.mtp.draft_probs(self.k), out["draft_probs_out"])
            next_ids, next_positions = self.inputs(ids, positions)
            self.arrays.advance_speculative_inputs(out["step_ids"], next_ids, next_positions, self._verified,
                                                   self._counts, self.last_start)
            self.target.states.select(out, self.rows, self._verified, out["accepted"], counts=self._counts)
            self.mtp.states.write(out, self.rows, self._verified, counts=self._counts)
            self._readbacks.start(n, out["step_ids"])
            self._outputs[n % 2] = out

    def _run(self, ids, positions, sampling: dict | None) -> dict:
        feeds = {"input_ids": ids, "positions": positions,
                 **self.target.states.feeds(self.rows, attention_window(self.graphs, positions, reach=1)),
                 **self.mtp.cache_feeds(self.rows, positions, drafts=self.k)}
        if self.sampled:
            feeds.update(sampling, draft_probs=self.draft_probs())
        return self.graphs[self.graph].run(feeds, slot=self._key, wait=False)

    def _bound_run(self, ids, positions, sampling: dict | None) -> dict:
        """The CPU's Run over IOBinding (``TargetModel.bound_forward``). A sampled run reads the drafts'
        distributions [B, k, V] in place where its rows are a range of the head's buffer; over a
        subset of rows they are gathered, a copy, so they are loaded into the binding every step."""
        feeds, in_place = {"input_ids": ids, "positions": positions, **(sampling or {})}, None
        if self.sampled:
            if self.rows.slice is not None:
                in_place = {"draft_probs": self.draft_probs()}
            else:
                feeds["draft_probs"] = self.draft_probs()
        return self.target.bound_forward(self.graph, self.rows, feeds, head=self.mtp, drafts=self.k,
                                         in_place=in_place)

    def draft_probs(self):
        """[B, k, V] float32 on the device: what the drafts of the next step to run were drawn from."""
        return self.rows.take(self.arrays, self.mtp.draft_probs(self.k))

    def inputs(self, ids=None, positions=None) -> tuple:
        """(input_ids, positions) [B, k+1] the next Run reads, holding the last Run's until the
        kernel advances them: the captured slot's static inputs (loaded by its run), else this
        object's own, loaded here from ids / positions when they are what the run was fed."""
        static = self.graphs.slots.static_input(self._key, "input_ids")
        if static is not None:
            return static, self.graphs.slots.static_input(self._key, "positions")
        own_ids, own_positions = self._own["input_ids"], self._own["positions"]
        if ids is not None and ids is not own_ids:  # the host inputs of a first step
            self.arrays.upload(own_ids, ids)
            self.arrays.upload(own_positions, positions)
        return own_ids, own_positions

    def read(self, n: int) -> np.ndarray:
        """int64 [B, 2k+2]: step n's emitted tokens e_0..e_k, accept lengths a, drafts d_1..d_k."""
        step_ids = self._readbacks.wait(n)
        self._read = n
        return step_ids

    def close(self) -> None:
        """As ``DecodeRun.close``: waits for a step run past the last read, reports kernel index errors."""
        with self.graphs.device_lock:
            try:
                self.graphs.begin_step()
            finally:
                self._outputs = [None, None]
