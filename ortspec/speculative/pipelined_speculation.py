"""Greedy speculation with the host one step ahead of the GPU (CUDA, runs of one k >= 1, one Run per step).

The plain speculative step makes the host wait for the GPU every step: it runs the fused verify
(``head_runs.CatchUpInVerify``), downloads step_ids, applies the acceptance rule, uploads the
commit's indices and the next step's inputs, commits; the GPU idles meanwhile. Every piece of
that control can be made on the device from the step_ids the graph wrote
(``runtime.device_verify``), so here the host enqueues step n+1 before it reads step n:

    enqueue step 0                                    ids [x_T, d1..dk], positions T..T+k: from the host
    for n = 0, 1, ...:
        enqueue step n+1 if it may be needed and fits   ids [g_a, the head's drafts], positions
                                                        T + a + 1 + 0..k: made on the device
        read step n's step_ids (waits for step n only); check its accept lengths with the host's
        greedy rule; emit d_1..d_a and g_a; keep the requests' bookkeeping; yield
        stop once every request is done, or when step n+1 was not enqueued

The host knows T only a step late: before it enqueues step n+1 it knows T_n exactly and that
T_{n+1} <= T_n + k + 1, so it enqueues only while every running row keeps T_{n+1} + k inside
max_length (the plain loop would run a decode step there). Otherwise it reads step n and
returns: every enqueued step has been read, the requests' tokens, next drafts and positions
are those of a plain loop after step n, and the Decoder's plain loop finishes the call.

Budgets: a step runs only while some running request may still be below its budget after the
step being read (which gives it at least one token). A request ended by a stop token or by
accepted drafts reaching its budget is known a step late, so step n+1 may have run for it; its
tokens are dropped and its states are never read (a finished row is not read again until a
prefill resets it). Finished rows keep running on their own drafts, positions parked at
max_length - k - 1.

Exactness: each step is the plain loop's fused step (same graph, captured slot, feeds and
commit, in the same order), rows never mix, and the host checks every step's accept lengths
against its own rule (a mismatch: ``InternalError``, a step late), so every running row's
tokens and states are bitwise the plain loop's.

Auto k (``num_speculative_tokens="auto"``): the loop runs an auto decoder's runs of one k >= 1
(any k with a fused graph). Step n's graph drafts k for step n+1, so before it enqueues step n+1
the loop asks the chooser for the k of step n+2, the one step n+1's graph drafts for (the plain
loop asks the same question during step n+1). If it is k, step n+1 is enqueued; if not, nothing
is, step n is read and the run ends drained with that choice (``pipelined.RunEnd.chosen_after``):
the Decoder's plain loop runs step n+1, which verifies the k drafts step n made and drafts for
the chosen k (two Runs; for k = 0 a greedy stretch follows), using that choice rather than
asking again, so the chooser sees one question per step as in the plain loop. Before step 0 it
asks the same way (the k of step 1): another k ends the run before any step. Per step it gives
the chooser the live rows' accept lengths and the step's time (``step_clock.StepClock``). The
states run a step ahead, so an on_commit hook (tests) is called only where a run ends drained,
for the requests whose rows ran no step past their end (``RunEnd.in_step``).

When it runs (``for_decoder``): what ``pipelined.runs_ahead`` asks of any loop one step ahead
(an auto decoder's hook aside: see above), the fused graph for its k (select commit, one stage,
not exact): a fixed k >= 1 with a graph, or auto k's ks with one; the MTP head's own drafts (a
scripted draft source replaces drafts on the host) and, per call, every request greedy with room
for a first step. Otherwise the Decoder runs its plain loop.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Callable

import numpy as np

from ..runtime.device_verify import DeviceVerify
from ..runtime.kv_window import RunBound
from . import sampler
from .auto_k import Tail
from .drafts import MTPDrafts
from .head_runs import acceptance_mismatch
from .pipelined import RunEnd, drain, runs_ahead
from .requests import Batch, Request
from .sampling import accept_lengths
from .step_clock import StepClock


class PipelinedSpeculation:
    """The pipelined speculative loop of one Decoder (module docstring)."""

    def __init__(self, decoder, ks: frozenset[int], emit: Callable[[Request, list], None]) -> None:
        self.graphs, self.target, self.mtp, self.stats = decoder.graphs, decoder.target, decoder.mtp, decoder.stats
        self.drafts, self.max_length, self.emit = decoder.drafts, decoder.max_length, emit
        self.chooser, self.ks = decoder.chooser, ks  # auto k (else chooser None); the ks whose runs it takes

    @classmethod
    def for_decoder(cls, decoder, pipelined: bool | None, exact, stages: int,
                    on_commit) -> "PipelinedSpeculation | None":
        """The loop for this Decoder, or None when it runs the plain loop (pipelined as for greedy)."""
        fused, auto = decoder.catch_up_in, decoder.chooser is not None
        if decoder.k < 1 or fused is None or type(decoder.drafts) is not MTPDrafts:
            return None
        ks = frozenset(k for k in fused.ks if k <= decoder.k) if auto else fused.ks & {decoder.k}
        if not ks or not runs_ahead(decoder, pipelined, exact, stages, None if auto else on_commit):
            return None
        return cls(decoder, ks, decoder._emit)

    def takes(self, requests: list[Request], k: int) -> bool:
        """Whether it runs these requests' next steps, of k drafts (one of its ks): some still
        running, every one greedy, room for a step."""
        live = [r for r in requests if not r.done]
        return k in self.ks and bool(live) and sampler.all_greedy(requests) and self._fits(live, k, 0)

    def steps(self, occupants: list[Request], k: int):
        """Steps of k drafts over ``occupants`` (every row, in row order) until every request is
        done, or too near max_length to run ahead, or (auto k) the chooser asks for another k;
        yields after each step's tokens are emitted. Returns a ``RunEnd``."""
        batch = Batch(occupants)
        batch.park_finished(self._last_start(k))
        T = batch.processed  # [B]: the first position of the step being read (host mirror of the device's)
        drafts = self.drafts.propose(batch, k)  # [B, k]: what that step verifies
        after = self._choose(occupants, k)  # the k of step 1, which step 0's graph drafts for
        if after != k:
            return RunEnd(k, [], after)  # nothing ran: the plain loop's step drafts for that choice
        clock = StepClock(self.chooser, self.graphs.slots, len(batch), k) if self.chooser else None
        verify = None
        try:
            with self.graphs.device_lock, self.stats.timed("verify"):
                self.graphs.begin_step()
                verify = DeviceVerify(self.target, self.mtp, batch.rows, k, RunBound.of(occupants))
                verify.step(0, np.concatenate([batch.pending[:, None], drafts], axis=1),  # [B, k+1]
                            T[:, None] + np.arange(k + 1))  # [B, k+1]
            for n in itertools.count():  # ends: every step gives each running request a token
                with self.graphs.device_lock, self.stats.timed("verify"):
                    running = [r for r in occupants if not r.done]  # before step n's tokens
                    more = self._may_need_another(occupants) and self._fits(occupants, k, k + 1, T)
                    after = self._choose(occupants, k) if more else None  # the k of step n+2 (auto k)
                    ahead = more and after == k
                    if ahead:
                        self.graphs.begin_step(check_errors=False)
                        verify.step(n + 1, *verify.inputs())
                    step_ids = verify.step_ids(n)  # [B, 2k+2]
                    if clock:
                        clock.read(n)
                T, drafts = self._take_step(occupants, T, drafts, step_ids)
                with clock.suspended() if clock else contextlib.nullcontext():
                    yield
                if not ahead or all(r.done for r in occupants):
                    return RunEnd(k, [] if ahead else running, None if ahead else after)
        finally:
            drain(self.graphs, verify)

    def _choose(self, occupants: list[Request], k: int) -> int:
        """(auto k) The chooser's k for a step (the loop runs generate calls: the static batch's
        tail, ``auto_k.Tail``); a fixed-k decoder's k."""
        return self.chooser.choose(len(occupants), Tail.of(occupants)) if self.chooser else k

    def _last_start(self, k: int) -> int:
        """The last first position T at which a step's k+1 positions fit in max_length."""
        return self.max_length - (k + 1)

    def _may_need_another(self, occupants: list[Request]) -> bool:
        """Whether a step after the one being read can matter: some running request will not have
        reached its budget with that step's tokens (at least one; a stop token is not known yet)."""
        return any(not r.done and r.output_length + 1 < r.max_new_tokens for r in occupants)

    def _fits(self, requests: list[Request], k: int, ahead: int, T: np.ndarray | None = None) -> bool:
        """Whether every running request's step of k drafts after ``ahead`` more positions still has its
        k+1 positions inside max_length (T [B], the positions of the step being read; default: processed)."""
        first = np.array([r.processed for r in requests]) if T is None else T
        running = np.array([not r.done for r in requests])
        return bool(np.all(first[running] + ahead <= self._last_start(k)))

    def _take_step(self, occupants: list[Request], T: np.ndarray, drafts: np.ndarray,
                   step_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Step n's results, read a step late: check the accept lengths, emit, keep the bookkeeping
        a plain step keeps (auto k: the chooser's accept lengths). Returns step n+1's first positions
        and drafts (the device's, mirrored)."""
        k = drafts.shape[1]
        tokens, accepted, next_drafts = step_ids[:, : k + 1], step_ids[:, k + 1], step_ids[:, k + 2:]  # [B, k+1], [B], [B, k]
        host = accept_lengths(drafts, tokens)  # a = longest prefix with d_i == g_{i-1}
        if not np.array_equal(host, accepted):
            raise acceptance_mismatch(k, accepted, host, drafts, tokens,
                                      "its rows' states are wrong until a prefill resets them")
        live = np.array([not r.done for r in occupants])
        self.stats.record_speculative_step(accepted[live], k, fused=True)
        self.stats.pipelined_speculative_steps += 1
        if self.chooser:
            self.chooser.record_accepts(accepted[live], k)
        for j, req in enumerate(occupants):
            req.next_drafts, req.draft_probs = next_drafts[j].tolist(), None
            if live[j]:
                req.last_first_position, req.last_accepted = int(T[j]), int(accepted[j])
                self.emit(req, list(drafts[j, : accepted[j]]) + [tokens[j, accepted[j]]])
        return np.minimum(T + accepted + 1, self._last_start(k)), next_drafts
