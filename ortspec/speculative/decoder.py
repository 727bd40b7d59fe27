"""Greedy and MTP-speculative decoding of a batch of requests.

The speculative step (``speculative_step``) is the heart of ortspec and reads top to
bottom: propose, verify, accept, commit. How to verify and commit is the commit strategy's
(``commits``); at which shape the target runs is the forward shapes' (``runtime.forward_shapes``);
state mechanics live in ``runtime.states``.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from ..errors import InputError
from ..runtime.engines import Engine
from ..runtime.forward_shapes import ExactShape, FixedShape, ShapePerCall
from ..runtime.graphs import GraphSet
from ..runtime.model import Forward, MTPHead
from ..runtime.states import Rows
from . import sampler
from .auto_k import KChooser, Tail
from .commits import COMMITS
from .deferred_entries import DeferredEntries
from .drafts import DraftSource, MTPDrafts
from .head_runs import CatchUpAfterVerify, CatchUpInVerify
from .pipelined import PipelinedGreedy
from .pipelined_speculation import PipelinedSpeculation
from .requests import Batch, Request
from .sampling import accept_lengths  # noqa: F401  (the greedy rule; imported from here by callers)
from .stats import Stats

PREFILL_GROUP_TOKENS = 4096  # prompt tokens per grouped prefill forward (bounds its [B, n, V] logits)


def pads_prompts(graphs: GraphSet) -> bool:
    """Whether the head may catch up over prompts of different lengths in one run, padded
    (``DeferredEntries.take_prompts``): on CUDA (states there match a plain decode within a
    tolerance), and on the CPU with float32 activations, where each row keeps its own bits
    (measured; float16 activations do not: ``deferred_entries``)."""
    return graphs.arrays.device != "cpu" or graphs.manifest.activations == "float32"


class Decoder:
    """Runs prefill, then greedy (k=0) or speculative (k>=1) steps until every request is done.

    One Decoder per generate call or batcher, over an ``Engine`` (state buffers for the batch)
    that its caller leased from the Session, or its own when none is given. Each step and
    prefill holds ``graphs.device_lock`` (on CUDA, steps of different callers never overlap).
    ``on_commit(decoder, batch)`` (tests) is called after every step's commit; in an auto
    decoder's runs of the loops one step ahead (``pipelined``), whose states run a step ahead,
    only where a run ends.

    On the CPU each step runs only the unfinished requests. On CUDA and in exact mode
    (``fixed_rows``) every step runs all rows, so the rows stay one contiguous range at fixed
    addresses; a finished request's row keeps running, parked where the widest forward stays
    inside max_length, and its results are dropped.

    commit: "select" or "readvance" (``commits.COMMITS``). exact: run every target forward at
    that one fixed shape (``runtime.forward_shapes.FixedShape``); batch_size must then be a
    multiple of its batch_size (placeholder requests fill the rest).

    Tokens are chosen by ``sampler``: the argmax for greedy requests, draws for sampled ones.

    k_chooser (``num_speculative_tokens="auto"``): k is then the most drafts a step may verify,
    and each step's k (``step_k``, 0..k) is chosen during the previous step, before the MTP
    head drafts for it (a speculative step: before its verify, whose graph may run the head;
    ``auto_k``). A plain decode step chosen that way leaves the head's entries for later
    (``deferred_entries``), and so does a prefill whose next step is one (its prompt's entries).
    In a generate call (``steps``: a static batch, no request joins) the chooser is told the
    batch's tail (``auto_k.Tail``: the slowest request sets the steps); a batcher's (``step``
    alone) is not.

    pipelined: generate calls on CUDA run ``PipelinedGreedy`` (``self.pipelined``: k = 0, and an
    auto decoder's stretches of k = 0 steps) and ``PipelinedSpeculation``
    (``self.pipelined_speculation``: a fixed k >= 1, and an auto decoder's runs of one k >= 1), the
    host a step ahead of the GPU, where they apply (their docstrings say where); None = that
    default, False = never, True = also on the CPU (tests). Batchers (``step``) always run the plain
    loop. A run of either loop ends drained and hands the plain loop the k of its next step, and
    for auto k's speculative runs the k of the step after it, already chosen (``pipelined.RunEnd``).

    fused_verify: where it can (``head_runs.CatchUpInVerify``), a speculative step runs the
    verify and the MTP head's catch-up in one graph (one Run); False: always two Runs.
    """

    def __init__(self, graphs: GraphSet, batch_size: int, k: int, commit: str, stats: Stats,
                 make_drafts: Callable[[MTPHead], DraftSource] = MTPDrafts,
                 on_commit: Callable[["Decoder", Batch], None] | None = None, fixed_rows: bool | None = None,
                 engine: Engine | None = None, stages: int = 1, exact: ExactShape | None = None,
                 k_chooser: KChooser | None = None, pipelined: bool | None = None, fused_verify: bool = True) -> None:
        self.graphs, self.k, self.stats, self.on_commit = graphs, k, stats, on_commit
        self.chooser = k_chooser
        self.static_batch = False  # set by steps(): a generate call's requests, none joins (auto_k.Tail)
        self.step_k = k if k_chooser is None else k_chooser.choose(batch_size)  # the drafts the next step verifies
        self.deferred = DeferredEntries(graphs.arrays, pad_lengths=pads_prompts(graphs))
        self._last_k: int | None = None  # the k the last step ran (None: none yet, a plain step for want of room,
        #                                   or a loop's run: the next plain step is no steady step)
        self._chosen_after: int | None = None  # the next step's choice of k for the step after it, made
        #                                        by a speculative run that ended before it (None: ask then)
        if exact is not None and fixed_rows is False:
            raise InputError("fixed_rows=False cannot run in exact mode: its forwards run every row, in groups "
                             "of exact_batch_size; leave fixed_rows unset.")
        self.fixed_rows = (graphs.arrays.device != "cpu" or exact is not None) if fixed_rows is None else fixed_rows
        self.max_length = graphs.manifest.max_length
        self.engine = engine or Engine.create(graphs, batch_size, k, stages)
        self.target, self.mtp = self.engine.target, self.engine.mtp
        self.forwards = FixedShape(self.target, exact) if exact else ShapePerCall(self.target)
        self.commit = COMMITS[commit](self.forwards)
        self.drafts = make_drafts(self.mtp) if k > 0 else None
        self.catch_up_after = CatchUpAfterVerify(self.commit, self._catch_up)  # the head in a Run of its own,
        self.catch_up_in = (CatchUpInVerify.create(self.engine, graphs.manifest, commit, exact is not None)
                            if fused_verify else None)  # or inside the verify's graph (None: never)
        # the loops one step ahead that run this decoder's k = 0 steps, and its k >= 1 steps (None: the plain loop)
        self.pipelined = PipelinedGreedy.for_decoder(self, pipelined, exact, stages, on_commit)
        self.pipelined_speculation = PipelinedSpeculation.for_decoder(self, pipelined, exact, stages, on_commit)

    # -- driver ----------------------------------------------------------------------------
    def generate(self, requests: list[Request]) -> list[list[int]]:
        for _ in self.steps(requests):
            pass
        return [r.output() for r in requests]

    def steps(self, requests: list[Request]):
        """Prefills the requests (rows in order), then steps until all are done; yields after the
        prefill and after every step, so a caller can stream each request's new tokens. The
        requests are a static batch: the chooser weighs their tail (``auto_k.Tail``)."""
        self.static_batch = True
        groups = self._prefill_groups(requests)
        for group in groups:  # several groups: the head's entries wait, to catch up in one run per row range
            self.prefill_group(group, defer_head=len(groups) > 1)
        tail = self._tail(Batch(requests)) if self.chooser else None  # where the call's steps start
        if tail is not None and self.deferred:  # no draft made yet: the call's first k, with its tail
            self.step_k = self.chooser.choose(len(requests), tail, fresh=True)
        self._catch_up_prompts()
        yield
        while True:
            loop = self._pipelined_loop(requests)
            if loop is not None:
                yield from self._pipelined_steps(loop, requests)
            if not self.step(requests):
                if tail is not None:  # the call's steps calibrate its k's tail (auto_k.KChooser.record_call)
                    self.chooser.record_call(len(requests), self.stats.steps_by_k, tail)
                return
            yield

    def _prefill_groups(self, requests: list[Request]) -> list[list[Request]]:
        """Runs of requests in consecutive rows with prompts of one length, at most
        PREFILL_GROUP_TOKENS prompt tokens each. On the CPU only: a token's bits there do not
        depend on the rows beside it (layers.py); a GPU library may pick another kernel for
        more rows, so on CUDA each request is prefilled alone, as it was checked."""
        if self.graphs.arrays.device != "cpu":
            return [[r] for r in requests]
        groups: list[list[Request]] = []
        for req in requests:
            last = groups[-1] if groups else None
            if (last and len(last[0].prompt) == len(req.prompt) and last[-1].row + 1 == req.row
                    and (len(last) + 1) * len(req.prompt) <= PREFILL_GROUP_TOKENS):
                last.append(req)
            else:
                groups.append([req])
        return groups

    def _catch_up_prompts(self) -> None:
        """After a call's prefills, when its first step speculates: the head over every waiting
        prompt, one run per range of consecutive rows (``DeferredEntries.take_prompts``), instead of
        a run per prefill group (on CUDA, per request). Auto k's k = 0 keeps them waiting."""
        if self.deferred and self.step_k > 0:
            with self.graphs.device_lock, self.stats.timed("prefill"):
                self._catch_up_deferred(self.step_k)

    def step(self, occupants: list[Request]) -> bool:
        """One step over the unfinished requests (all occupants when rows are fixed); False
        when none is left. ``occupants`` are the requests holding rows, in row order."""
        active = [r for r in occupants if not r.done]
        if not active:
            return False
        batch = Batch(occupants if self.fixed_rows else active)
        batch.park_finished(self.max_length - self.forwards.positions_used(self.k))
        k, previous_k = self.step_k, self._last_k
        with self.graphs.device_lock:
            # timed from before begin_step: on CUDA it waits for the last step's device work still
            # queued (the commit's kernels, and what a Run left running), part of a step's period
            start, setups = time.perf_counter(), self.graphs.slots.setup_runs
            self.graphs.begin_step()
            room = self.max_length - 1 - int(batch.processed.max())  # last writable position - T
            if k > 0 and room >= k:
                self.speculative_step(batch, k)
            else:
                self.greedy_step(batch)
            ran = k if k == 0 or room >= k else None
            if self.chooser and previous_k == ran == self.step_k and self.graphs.slots.setup_runs == setups:
                # only a steady step measures k: neither k changed around it nor was a CUDA graph set up
                self.chooser.record_time(len(batch), k, time.perf_counter() - start)
            self._last_k = ran
            if self.on_commit:
                self.on_commit(self, batch)
        return True

    def _pipelined_loop(self, requests: list[Request]):
        """The loop one step ahead that takes the next steps (of ``step_k`` drafts), or None."""
        for loop in (self.pipelined, self.pipelined_speculation):
            if loop is not None and loop.takes(requests, self.step_k):
                return loop
        return None

    def _pipelined_steps(self, loop, requests: list[Request]):
        """Steps a step ahead of the GPU until every request is done, or the speculative loop
        nears max_length, or (auto k) the chooser asks for another k; then the plain loop takes
        over from where the run ended, drained (``pipelined.RunEnd``): after a stretch of k = 0
        steps the head catches up over the stretch's entries."""
        end = yield from loop.steps(requests, self.step_k)
        self.step_k, self._chosen_after, self._last_k = end.next_k, end.chosen_after, None
        if self.deferred and self.step_k:
            with self.graphs.device_lock, self.stats.timed("commit"):
                self._catch_up_deferred(self.step_k)
        if self.on_commit and end.in_step:  # (auto k) the only point of a run where states are in step
            with self.graphs.device_lock:
                self.on_commit(self, Batch(end.in_step))

    def take_stats(self) -> Stats:
        """The counters since the last take (a batcher reports them to its Session after each call)."""
        stats, self.stats = self.stats, Stats()
        return stats

    def prefill(self, req: Request) -> None:
        self.prefill_group([req])

    def prefill_group(self, requests: list[Request], defer_head: bool = False) -> None:
        """Requests with prompts of one length n in consecutive rows, in one forward: the target
        over the prompts (positions 0..n-1) -> each first token; then the MTP head's entries 0..n-1,
        or those entries left for later (``deferred_entries``): where the caller merges several
        groups' catch-ups (defer_head), or (auto k) where the next step is a plain decode: greedy
        does not pay for a head it does not use."""
        rows, n = Rows([r.row for r in requests]), len(requests[0].prompt)
        self.deferred.drop_rows(rows)  # a reused row's waiting prompt entries were its last request's
        defer_head = defer_head or (self.chooser is not None and self.step_k == 0)
        if self.deferred.has_steps or (self.deferred and not defer_head):
            # the rows stepping beside these catch up first: deferred rows stay in step
            with self.graphs.device_lock, self.stats.timed("commit"):
                self._catch_up_deferred(max(self.step_k, 1))
        ids = np.array([r.prompt for r in requests], np.int64)  # [B, n]
        positions = np.tile(np.arange(n, dtype=np.int64), (len(requests), 1))  # [B, n]
        last = np.full(len(requests), n - 1, np.int64)  # [B]
        with self.graphs.device_lock, self.stats.timed("prefill"):
            self.target.reset(rows)
            out = self.target.prefill(rows, ids, positions)
            for req in requests:
                req.tokens = list(req.prompt)
            first = sampler.pick(requests, out, last)  # [B]
            if self.mtp is not None:
                next_ids = np.concatenate([ids[:, 1:], first[:, None]], axis=1)  # x_{p+1} for every p  [B, n]
                if defer_head:
                    self.deferred.add_prompts(requests, rows, out["hidden"], next_ids)
                else:
                    self._catch_up(rows, out["hidden"], next_ids, out.positions, last, requests,
                                   max(self.step_k, 1), graphed=False)
        for req, token in zip(requests, first):
            req.extend([token])
            if not req.placeholder:
                self.stats.requests += 1
                self.stats.prompt_tokens += n
                self.stats.generated_tokens += 1

    # -- one step --------------------------------------------------------------------------
    def greedy_step(self, batch: Batch) -> None:
        """Plain decode: one target forward of x_T per row (and its MTP entry, when speculating)."""
        with self.stats.timed("decode"):
            out = self.forwards.advance(batch.rows, batch.pending[:, None], batch.processed[:, None])
            tokens = sampler.pick(batch.requests, out, np.zeros(len(batch), np.int64))  # [B]
            if self.chooser is not None:
                self._defer_or_catch_up(batch, out, tokens)
            elif self.mtp is not None:
                self._catch_up(batch.rows, out["hidden"], tokens[:, None], out.positions, np.zeros(len(batch), np.int64),
                               batch.requests, self.k)
        self.stats.record_decode_step()
        for req, T, t in zip(batch.requests, batch.processed, tokens):
            if not req.done:
                req.last_first_position, req.last_accepted = int(T), 0  # a decode step accepts no draft
                self._emit(req, [t])

    def speculative_step(self, batch: Batch, k: int) -> None:
        T = batch.processed
        self._check_positions(batch)
        # 1. propose: k drafts per request                                         [B, k]
        with self.stats.timed("propose"):
            drafts = self.drafts.propose(batch, k)
        self.step_k = self._choose_next(batch, k)  # the next step's k
        head = self._head_runs(batch, k)  # the MTP head in its own Run, or in the verify's graph
        # 2. verify: one target forward over [x_T, d_1..d_k] at positions T..T+k   [B, k+1]
        ids = np.concatenate([batch.pending[:, None], drafts], axis=1)
        positions = T[:, None] + np.arange(k + 1)
        with self.stats.timed("verify"):
            verified = head.verify(batch, ids, positions)
        # 3. accept: greedy rows: a = longest prefix with d_i == g_{i-1} (g: the target's argmaxes),
        #    bonus g_a. Sampled rows: d_i kept with probability min(1, p_{i-1}(d_i) / q_i(d_i)),
        #    bonus drawn from norm(max(0, p_a - q_{a+1})), or from p_k when a = k (sampling.py).
        #    Emit d_1..d_a and the bonus. Both read the verify's first k+1 rows (exact mode: pads follow).
        accepted, bonus = sampler.accept(batch.requests, drafts, verified.out)  # [B], [B]
        # 4. commit every state to T + a + 1 tokens, as if decoded one by one: the MTP head
        #    first (it reads the verify's hiddens, which readvance's re-runs may overwrite)
        with self.stats.timed("commit"):
            head.catch_up(batch, verified, accepted, bonus, max(self.step_k, 1))
            self.commit.commit(batch, verified, accepted, self.stats)
        live = np.array([not r.done for r in batch.requests])
        self.stats.record_speculative_step(accepted[live], k, fused=head is self.catch_up_in)
        if self.chooser:
            self.chooser.record_accepts(accepted[live], k)
        for j, req in enumerate(batch.requests):
            if live[j]:
                req.last_first_position, req.last_accepted = int(T[j]), int(accepted[j])
                self._emit(req, list(drafts[j, : accepted[j]]) + [bonus[j]])

    # -- MTP catch-up and bookkeeping -------------------------------------------------------
    def _head_runs(self, batch: Batch, k: int) -> CatchUpAfterVerify | CatchUpInVerify:
        """One Run for this step where the fused graph applies (``head_runs``), else two."""
        fused = self.catch_up_in
        return fused if fused is not None and fused.applies(batch.requests, k, self.step_k) else self.catch_up_after

    def _defer_or_catch_up(self, batch: Batch, out: Forward, tokens: np.ndarray) -> None:
        """Auto k after a plain decode: choose the next step's k; for k = 0 leave the head's entry
        for later, else catch up over every entry left so far and this one, drafting k."""
        self.deferred.add(batch.requests, batch.rows, out["hidden"], tokens, out.positions[:, 0])
        self.step_k = self._choose_next(batch, 0)
        if self.step_k > 0:
            self._catch_up_deferred(self.step_k)

    def _choose_next(self, batch: Batch, k: int) -> int:
        """The k of the step after this one (of k drafts): the chooser's, asked now or, where a
        speculative run ended just before this step, when that run did (``RunEnd.chosen_after``:
        asked once, as in the plain loop); a fixed-k decoder's k."""
        chosen, self._chosen_after = self._chosen_after, None
        if chosen is not None:
            return chosen
        return self.chooser.choose(len(batch), self._tail(batch)) if self.chooser else k

    def _tail(self, batch: Batch) -> Tail | None:
        """What the chooser weighs beside E(k): a generate call's tail (its slowest request sets
        the steps; the calls calibrate the model, ``KChooser.record_call``); none in a batcher
        (requests join). Where a step runs only the live requests (the CPU) the tail's steps are
        cheaper than full ones, so the tail weighs a little more than it costs there; without it
        the CPU at batch 4 kept k = 3 or 4 where k = 2 was 7-14% faster (BENCHMARKS.md)."""
        return Tail.of(batch.requests) if self.static_batch else None

    def _catch_up_deferred(self, drafts: int) -> None:
        """The head over the entries left for later (``DeferredEntries``): first the waiting
        prompts, one run per range of consecutive rows, then the plain decode steps' entries in one
        run (entry p of the head's cache follows entries 0..p-1)."""
        for requests, rows, hidden, next_ids, positions, last in self.deferred.take_prompts():
            self._catch_up(rows, hidden, next_ids, positions, last, requests, drafts, graphed=False)
        if self.deferred.has_steps:
            requests, rows, hidden, next_ids, positions, last = self.deferred.take()
            self._catch_up(rows, hidden, next_ids, positions, last, requests, drafts, graphed=False)

    def _catch_up(self, rows: Rows, hidden, next_ids, positions, last, requests, drafts: int, graphed=True) -> None:
        """MTP entries T..T+last[j] from the target forward's hiddens [B, W, H] at positions
        [B, W] and the tokens that followed (next_ids [B, m]; padded to W, rows past last[j]
        are padding and never written); the head's output at last[j] is the next step's d1,
        followed by d2..d_drafts. Sampled requests' drafts are drawn, and the distributions
        they came from kept for the acceptance."""
        width = positions.shape[1]
        if next_ids.shape[1] < width:  # exact mode: the forward ran K_fix+1 rows
            next_ids = np.concatenate([next_ids, np.zeros((len(next_ids), width - next_ids.shape[1]), np.int64)], 1)
        sampling = sampler.draft_inputs(requests, drafts)
        if sampling is None:
            drafts = self.mtp.catch_up(rows, hidden, next_ids, positions, last, drafts, graphed=graphed)  # [B, k]
            probs = [None] * len(requests)
        else:
            drafts, probs = self.mtp.catch_up_sampled(rows, hidden, next_ids, positions, last, drafts, sampling,
                                                      graphed=graphed)  # [B, k], [B, k, V]
        for req, row, q in zip(requests, drafts, probs):
            req.next_drafts, req.draft_probs = row.tolist(), q if req.samples else None

    def _check_positions(self, batch: Batch) -> None:
        """The last accept length again, from positions: this step's first position minus the
        last step's, minus the bonus token. The states follow positions (every commit writes
        at T..T+a), so on disagreement positions win; the counter exposes the bug."""
        for req in batch.requests:
            if req.last_first_position is None or req.done:
                continue
            if req.processed - req.last_first_position - 1 != req.last_accepted:
                self.stats.position_mismatches += 1

    def _emit(self, req: Request, tokens) -> None:
        before = req.output_length
        req.extend(tokens)
        self.stats.generated_tokens += req.output_length - before
