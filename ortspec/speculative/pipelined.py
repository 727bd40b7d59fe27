"""Greedy decoding with the host one step ahead of the GPU (CUDA, k = 0).

The plain greedy step (``Decoder.greedy_step``) makes the host wait for the GPU every step: it
uploads ids and positions, runs the graph, waits for it, downloads the argmax, then commits and
does its bookkeeping while the GPU idles (the GPU was busy about half of a step on the H200,
BENCHMARKS.md). Here the host enqueues step n+1 before it reads step n's tokens, so the GPU
always has the next step queued (``runtime.device_decode`` enqueues; the stream orders):

    enqueue step 0                                      ids, positions: from the host
    for n = 0, 1, ...:
        enqueue step n+1 unless no request can need it  ids: step n's tokens; positions one on:
                                                        both made on the device
        read step n's tokens (waits for step n only), emit them, yield
        stop once every request is done

Budgets (max_new_tokens) are known, so no step runs once every request will have reached its
budget; a stop token is known only a step late, so a request ended by one has had one more
step run for it, whose token is dropped. That step's states are never read: a finished row is not read again until a prefill
resets it (a plain loop keeps running finished rows too, with their results dropped).

Exactness: each step is the plain loop's decode (same graph, captured slot, feeds and commit),
and rows never mix, so every live row's tokens and states are bitwise the plain loop's. Only
finished rows see other inputs (their own tokens, positions counting on, clamped to max_length).

When it runs (``PipelinedGreedy.for_decoder``): k = 0, one pipeline stage, not exact mode, fixed
rows, no on_commit hook (it inspects the states after every step; here they run a step ahead),
greedy requests only (a sampled token needs the logits on the host), and on CUDA the stream
shared with ONNX Runtime (``runtime.streams``). Otherwise the Decoder runs its plain loop, as
batchers always do: they step one step at a time (``Decoder.step``).
"""

from __future__ import annotations

import itertools
from typing import Callable

import numpy as np

from ..runtime.device_decode import DeviceDecode
from .requests import Batch, Request


def runs_ahead(decoder, pipelined: bool | None, exact, stages: int, on_commit) -> bool:
    """Whether a loop one step ahead of the GPU may run this Decoder's steps (greedy here, speculative
    in ``pipelined_speculation``): wanted (pipelined None: on CUDA only; True: also on the CPU, where
    the tests check the loops bitwise; False: never), one stage, not exact, fixed rows, no on_commit
    hook, and on CUDA the stream shared with ONNX Runtime."""
    arrays = decoder.graphs.arrays
    wanted = arrays.device != "cpu" if pipelined is None else pipelined
    return bool(wanted and stages == 1 and exact is None and decoder.fixed_rows and on_commit is None
                and (arrays.device == "cpu" or arrays.shared_stream))


def drain(graphs, device_steps) -> None:
    """The end of a loop one step ahead: waits for a step run past the end and reports any index
    error a kernel recorded (``begin_step``), then closes ``device_steps`` (DeviceDecode or
    DeviceVerify, None if never made), under the device lock, even if the check raised."""
    with graphs.device_lock:
        try:
            graphs.begin_step()
        finally:
            if device_steps is not None:
                device_steps.close()


class PipelinedGreedy:
    """The pipelined loop of one Decoder (module docstring)."""

    def __init__(self, decoder, emit: Callable[[Request, list], None]) -> None:
        self.graphs, self.target, self.stats = decoder.graphs, decoder.target, decoder.stats
        self.max_length, self.emit = decoder.max_length, emit

    @classmethod
    def for_decoder(cls, decoder, pipelined: bool | None, exact, stages: int, on_commit) -> "PipelinedGreedy | None":
        """The loop for this Decoder, or None when it runs the plain loop. pipelined: None (default)
        on CUDA only; True also on the CPU (tests check the loop there bitwise); False never."""
        return cls(decoder, decoder._emit) if decoder.k == 0 and runs_ahead(decoder, pipelined, exact, stages,
                                                                             on_commit) else None

    def takes(self, requests: list[Request]) -> bool:
        """Whether it runs these requests: some still running, none sampling."""
        return any(not r.done for r in requests) and not any(r.samples for r in requests)

    def steps(self, occupants: list[Request]):
        """Steps ``occupants`` (every row, in row order) until every request is done; yields after
        each step's tokens are emitted."""
        batch = Batch(occupants)
        batch.park_finished(self.max_length - 1)
        first = batch.processed  # T [B]: the position of step 0's input

        def positions(n: int) -> np.ndarray:  # [B, 1]: step n's, a finished row's clamped inside the buffers
            return np.minimum(first + n, self.max_length - 1)[:, None]

        decode = None
        try:
            with self.graphs.device_lock, self.stats.timed("decode"):
                self.graphs.begin_step()
                decode = DeviceDecode(self.target, batch.rows)  # (page-locked memory: made and freed under the lock)
                out = decode.step(0, batch.pending[:, None], positions(0))
            for n in itertools.count():  # ends: every step gives each running request a token
                with self.graphs.device_lock, self.stats.timed("decode"):
                    if self._may_need_another(occupants):
                        self.graphs.begin_step(check_errors=False)
                        out = decode.step(n + 1, *decode.feed(out, positions(n + 1)))
                    tokens = decode.tokens(n)  # [B]
                self._emit_step(occupants, tokens)
                yield
                if all(r.done for r in occupants):
                    return
        finally:
            drain(self.graphs, decode)

    def _may_need_another(self, occupants: list[Request]) -> bool:
        """Whether a step after the one being read can matter: some request still running will
        not have reached its budget with that step's token (a stop token is not known yet)."""
        return any(not r.done and r.output_length + 1 < r.max_new_tokens for r in occupants)

    def _emit_step(self, occupants: list[Request], tokens: np.ndarray) -> None:
        self.stats.record_decode_step()
        self.stats.pipelined_steps += 1
        for req, token in zip(occupants, tokens):
            if not req.done:
                self.emit(req, [token])
