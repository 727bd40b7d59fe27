"""Greedy decoding with the host one step ahead of the GPU (CUDA, k = 0 steps).

The plain greedy step (``Decoder.greedy_step``) makes the host wait for the GPU every step: it
uploads ids and positions, runs the graph, waits for it, downloads the argmax, then commits and
does its bookkeeping while the GPU idles (the GPU was busy about half of a step on the H200,
BENCHMARKS.md). Here the host enqueues step n+1 before it reads step n's tokens, so the GPU
always has the next step queued (``runtime.device_decode`` enqueues; the stream orders):

    enqueue step 0                                      ids, positions: from the host
    for n = 0, 1, ...:
        enqueue step n+1 unless no request can need it  ids: step n's tokens; positions one on:
                                                        both made on the device
          (auto k: or the chooser asks for drafts)
        read step n's tokens (waits for step n only), emit them, yield
        stop once every request is done (auto k: or nothing was enqueued after step n)

Budgets (max_new_tokens) are known, so no step runs once every request will have reached its
budget; a stop token is known only a step late, so a request ended by one has had one more
step run for it, whose token is dropped. That step's states are never read: a finished row is not read again until a prefill
resets it (a plain loop keeps running finished rows too, with their results dropped).

Exactness: each step is the plain loop's decode (same graph, captured slot, feeds and commit),
and rows never mix, so every live row's tokens and states are bitwise the plain loop's. Only
finished rows see other inputs (their own tokens, positions counting on, clamped to max_length).

Auto k (``num_speculative_tokens="auto"``): while the chooser gives k = 0, the steps run here
as a stretch (``auto_stretch``): each step also reads its hidden rows back a step late for the
MTP head's deferred entries and is timed for the chooser, and the chooser is asked before each
enqueue. When it asks for drafts, the stretch ends drained (nothing runs ahead) and returns that
k; the Decoder catches the head up over the stretch's entries and runs its speculative steps
(in runs of one k in ``pipelined_speculation`` where that applies) until the chooser gives k = 0
again.

When it runs (``PipelinedGreedy.for_decoder``): k = 0 or auto k, one pipeline stage, not exact
mode, fixed rows, greedy requests only (a sampled token needs the logits on the host), and on
CUDA the stream shared with ONNX Runtime (``runtime.streams``); no on_commit hook for a plain
decoder (the hook inspects the states after every step, and here they run a step ahead: it would
see only the last). An auto decoder's stretches end drained and hand back to the plain loop, so
there a hook is called at each stretch's end (``RunEnd.in_step``), after the head's catch-up:
``exactness.check_speculative(pipelined=True)`` checks the states there. Otherwise the Decoder
runs its plain loop, as batchers always do: they step one step at a time (``Decoder.step``).
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Callable, NamedTuple

import numpy as np

from ..runtime.device_decode import DeviceDecode
from ..runtime.kv_window import RunBound
from .auto_stretch import AutoStretch
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


class RunEnd(NamedTuple):
    """How a run of a loop one step ahead ended, drained: where the Decoder's plain loop takes over."""

    next_k: int  # the drafts the next step verifies: greedy, the chooser's choice (0: none, or every request
    #              is done); speculation, the run's k (its last step drafted k for the next)
    in_step: list[Request]  # the requests whose rows ran no step past their end: their states are their tokens'
    chosen_after: int | None = None  # (auto k, speculation) the k of the step after the next, chosen before the
    #                                  run ended: the next step drafts for it (None: the chooser is asked then)


class PipelinedGreedy:
    """The pipelined loop of one Decoder (module docstring)."""

    def __init__(self, decoder, emit: Callable[[Request, list], None]) -> None:
        self.graphs, self.target, self.stats = decoder.graphs, decoder.target, decoder.stats
        self.max_length, self.emit = decoder.max_length, emit
        self.chooser, self.deferred = decoder.chooser, decoder.deferred  # auto k (else chooser None)

    @classmethod
    def for_decoder(cls, decoder, pipelined: bool | None, exact, stages: int, on_commit) -> "PipelinedGreedy | None":
        """The loop for this Decoder, or None when it runs the plain loop. pipelined: None (default)
        on CUDA only; True also on the CPU (tests check the loop there bitwise); False never."""
        auto = decoder.chooser is not None  # its hook is called where a stretch ends (module docstring)
        if not (decoder.k == 0 or auto) or not runs_ahead(decoder, pipelined, exact, stages, None if auto else on_commit):
            return None
        return cls(decoder, decoder._emit)

    def takes(self, requests: list[Request], k: int) -> bool:
        """Whether it runs these requests' next steps, of k drafts: k = 0, some still running, none sampling."""
        return k == 0 and any(not r.done for r in requests) and not any(r.samples for r in requests)

    def steps(self, occupants: list[Request], k: int = 0):
        """Steps ``occupants`` (every row, in row order) until every request is done or (auto k)
        the chooser asks for drafts; yields after each step's tokens are emitted. Returns a
        ``RunEnd`` (the value of ``yield from``). k: the steps' drafts, 0 (what ``takes`` took)."""
        batch = Batch(occupants)
        batch.park_finished(self.max_length - 1)
        first = batch.processed  # T [B]: the position of step 0's input
        auto = AutoStretch(self.chooser, self.deferred, self.graphs.slots, batch) if self.chooser else None

        def positions(n: int) -> np.ndarray:  # [B, 1]: step n's, a finished row's clamped inside the buffers
            return np.minimum(first + n, self.max_length - 1)[:, None]

        decode = None
        try:
            with self.graphs.device_lock, self.stats.timed("decode"):
                self.graphs.begin_step()
                decode = DeviceDecode(self.target, batch.rows, hidden=auto is not None, bound=RunBound.of(occupants))
                out = decode.step(0, batch.pending[:, None], positions(0))  # (page-locked memory: made, freed under the lock)
            for n in itertools.count():  # ends: every step gives each running request a token
                with self.graphs.device_lock, self.stats.timed("decode"):
                    running = [r for r in occupants if not r.done]  # before step n's tokens
                    more = self._may_need_another(occupants)
                    next_k = auto.next_k() if auto and more else 0  # the chooser: before the step it chooses for
                    ahead = more and next_k == 0
                    if ahead:
                        self.graphs.begin_step(check_errors=False)
                        out = decode.step(n + 1, *decode.feed(out, positions(n + 1)))
                    tokens = decode.tokens(n)  # [B]
                    if auto:
                        auto.record_step(decode, n, tokens, positions(n)[:, 0])
                self._emit_step(occupants, tokens, first + n)
                with auto.suspended() if auto else contextlib.nullcontext():
                    yield
                if not ahead or all(r.done for r in occupants):
                    still = any(not r.done for r in occupants)
                    return RunEnd(next_k if still else 0, [] if ahead else running)
        finally:
            drain(self.graphs, decode)

    def _may_need_another(self, occupants: list[Request]) -> bool:
        """Whether a step after the one being read can matter: some request still running will
        not have reached its budget with that step's token (a stop token is not known yet)."""
        return any(not r.done and r.output_length + 1 < r.max_new_tokens for r in occupants)

    def _emit_step(self, occupants: list[Request], tokens: np.ndarray, positions: np.ndarray) -> None:
        """tokens [B] of a step at positions [B] (a later speculative step checks its accept
        length against them: ``Decoder._check_positions``)."""
        self.stats.record_decode_step()
        self.stats.pipelined_steps += 1
        for req, token, T in zip(occupants, tokens, positions):
            if not req.done:
                req.last_first_position, req.last_accepted = int(T), 0  # a decode step accepts no draft
                self.emit(req, [token])
