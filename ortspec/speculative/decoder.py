"""The one loop: the steps of every caller (``Session.generate``, the batcher, the server) run here.

    admit(requests)   prefills new requests into their rows, between steps: the join
    step()            reads one step of every running row; at depth 1 the step after it is
                      enqueued first, where it goes on with the same run
    drain()           reads what is in flight (before a join, at the end); close() too

A run is a sequence of steps of one kind (``step_kinds``) over the same rows. At depth 0 (the
CPU) a step is read right after it is enqueued; at depth 1 (CUDA) the host enqueues step n+1
before it reads step n, so the GPU always has the next step queued, and the host knows each
row a step late. Both depths run the same kinds, so tokens and states are bitwise equal. A
run ends, read out, where the next step is of another kind or k (the policy's choice, room
before max_length, a sampled row), where a request joins, or where no request can need
another step. Rows leave (finished, cancelled, timed out) without ending it: a finished row
runs on with its results dropped, and its row is free for the next prefill.

The policy (``k_policy``) is asked once per step, when the step is planned, for the drafts
its MTP head makes: the k of the step after it. A decode step's head entries wait
(``head.Head``) until a step drafts again.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from typing import Callable, ContextManager, NamedTuple

import numpy as np

from ..errors import InputError
from ..runtime.engines import Engine
from ..runtime.forward_shapes import ExactShape, FixedShape, ShapePerCall
from ..runtime.graph_slots import batch_bucket
from ..runtime.graphs import GraphSet
from ..runtime.model import Forward, MTPHead
from ..runtime.prefill_thread import PrefillThread
from ..runtime.states import Rows
from . import logprobs, sampler
from .auto_k import KChooser, Tail
from .commits import COMMITS
from .drafts import DraftSource, MTPDrafts
from .head import Head
from .k_policy import KScript, StepRecord, policy_for
from .requests import Batch, Request
from .stats import Stats
from .step_kinds import FusedSteps, StepKinds, StepResult, fusable_ks, sampling_ks

PREFILL_GROUP_TOKENS = 4096  # prompt tokens per grouped prefill forward (bounds its [B, n, V] logits)


class Plan(NamedTuple):
    """One step: its kind, the drafts it verifies (k), the drafts its head makes for the next
    step (its k), and the rows it runs. A step goes on with the open run where its plan is the run's."""

    kind: type
    k: int
    drafts: int
    rows: tuple[int, ...]

    def continues(self, first: "Plan") -> bool:
        """Whether this step can be the next of a run that began with ``first``: the same kind, k
        and rows, and the same drafts where the head runs in the step (a decode's head entries
        wait: its drafts decide only what follows its read)."""
        return (self.kind, self.k, self.rows) == (first.kind, first.k, first.rows) and \
            (self.k == 0 or self.drafts == first.drafts)


@dataclasses.dataclass(eq=False)
class Run:
    plan: Plan
    steps: object  # the kind's object over the run's rows
    requests: list[Request]  # the requests holding those rows, in row order
    rows: Rows
    n: int = 0  # the last step enqueued


class Flight(NamedTuple):
    run: Run
    n: int
    plan: Plan
    ahead: bool  # enqueued before the step before it was read


class Join(NamedTuple):
    """What a prompt's prefill on the prefill thread is for: the requests it seats (the prompt's,
    then its forks'), the forks by row, and its ids and positions [1, n]."""

    requests: list[Request]
    copies: dict[int, list[Request]]
    ids: np.ndarray
    positions: np.ndarray


@dataclasses.dataclass
class Pipeline:
    """What the loop has going: the open run, the step enqueued ahead of the read (depth 1), and
    the policy's answer for a step not planned yet (it was asked a step early)."""

    depth: int  # 0: each step read right after it is enqueued; 1: a step ahead of the reads
    run: Run | None = None
    flight: Flight | None = None
    chosen: int | None = None


class Decoder:
    """The loop over one engine's rows (module docstring).

    make_drafts: the draft source (tests script drafts with it). on_commit(decoder, batch)
    (tests): called after a step's commit wherever no step is in flight, with the requests
    that took part in it. fixed_rows: a step runs rows 0.. up to the last running one, bucketed
    (CUDA; every row in exact mode), else the running rows only (the CPU). exact: every target forward at that one fixed shape.
    k_chooser: auto k (k is then the most drafts a step verifies). pipelined: depth 1 (None:
    on CUDA where the stream is shared with ONNX Runtime; True: also on the CPU, for tests;
    False: depth 0). fused_verify=False: never the fused graph (A/B runs). background_prefill:
    ``submit`` runs prefills on a thread of their own (None: at depth 1 on CUDA; True: also on
    the CPU, for tests; False: never).
    """

    def __init__(self, graphs: GraphSet, batch_size: int, k: int, commit: str, stats: Stats,
                 make_drafts: Callable[[MTPHead], DraftSource] = MTPDrafts,
                 on_commit: Callable[["Decoder", Batch], None] | None = None, fixed_rows: bool | None = None,
                 engine: Engine | None = None, stages: int = 1, exact: ExactShape | None = None,
                 k_chooser: KChooser | None = None, pipelined: bool | None = None, fused_verify: bool = True,
                 background_prefill: bool | None = None) -> None:
        if exact is not None and fixed_rows is False:
            raise InputError("fixed_rows=False cannot run in exact mode: its forwards run every row, in groups "
                             "of exact_batch_size; leave fixed_rows unset.")
        arrays = graphs.arrays
        self.stats, self.on_commit = stats, on_commit
        self.engine = engine or Engine.create(graphs, batch_size, k, stages)
        self.policy = policy_for(k, k_chooser)
        self.fixed_rows = (arrays.device != "cpu" or exact is not None) if fixed_rows is None else fixed_rows
        forwards = FixedShape(self.engine.target, exact) if exact else ShapePerCall(self.engine.target)
        mtp = self.engine.mtp
        head = Head(mtp, arrays, pad_lengths=pads_prompts(graphs)) if mtp is not None else None
        source = make_drafts(mtp) if mtp is not None else None
        device = stages == 1 and exact is None and (arrays.device == "cpu" or arrays.shared_stream)
        fused = fusable_ks(graphs.manifest, commit, exact is not None, stages) if fused_verify else frozenset()
        self.kinds = StepKinds(self.engine, forwards, COMMITS[commit](forwards), source, head, stats, device, fused,
                               sampling_ks(graphs.manifest, fused, source) if device else frozenset())
        self.occupants: list[Request | None] = [None] * batch_size  # by row
        self.static = False  # a generate call's requests: no request joins (auto k weighs their tail)
        self.next_k = 0  # the drafts the rows hold: what the next step verifies
        self._pipe = Pipeline(int(device and (arrays.device != "cpu" if pipelined is None else pipelined)))
        self._clock = StepClock(graphs, self._pipe.depth)
        apart = prefills_apart(graphs, self._pipe.depth) if background_prefill is None else background_prefill
        self._prefills = PrefillThread() if apart and device else None  # its jobs' records are Joins

    @property
    def graphs(self) -> GraphSet:
        return self.engine.target.graphs

    @property
    def head(self) -> Head | None:
        """The MTP head's side of the steps (None without one): its deferred entries."""
        return self.kinds.head

    @property
    def depth(self) -> int:
        return self._pipe.depth

    @property
    def max_length(self) -> int:
        return self.graphs.manifest.max_length

    @property
    def target(self):
        return self.engine.target

    @property
    def mtp(self):
        return self.engine.mtp

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> bool:
        """Reads one step, the next enqueued first where it goes on with the run; False when no row runs."""
        with self._clock.inside():
            self._admit_prefilled()
            flight = self._pipe.flight or self._enqueue(self._plan())
            if flight is None:
                return False
            self._pipe.flight = self._enqueue(self._plan_ahead(flight), ahead=True) if self._pipe.depth else None
            self._record(flight, flight.run.steps.read(flight.n))
            return True

    def _plan(self) -> tuple[Plan, list[Request]] | None:
        """The next step from the host's view of the rows (nothing in flight). Prompts admitted
        since the last step catch up first where it drafts: one head run per range of rows."""
        running = self.running
        if not running:
            return None
        if self.next_k > 0 and self.head.waiting:
            with self.engine.step(), self.stats.timed("prefill"):
                self.head.catch_up_deferred(self.next_k)
        requests = self._step_rows(running)
        room = self.max_length - 1 - max(r.processed for r in running)  # last writable position - T
        k = self.next_k if room >= self.next_k else 0
        drafts, self._pipe.chosen = self._pipe.chosen if self._pipe.chosen is not None else self._ask(requests), None
        return Plan(self.kinds.choose(requests, k, drafts), k, drafts, tuple(r.row for r in requests)), requests

    def _step_rows(self, running: list[Request]) -> list[Request]:
        """The requests a step runs: the running ones (the CPU); with fixed rows (CUDA) the rows
        from 0 up to the last running one, rounded up to a CUDA-graph batch bucket (a free row
        among them holds a finished placeholder), so a server with one request steps one row;
        in exact mode every row (whole groups of exact_batch_size)."""
        if not self.fixed_rows:
            return running
        if isinstance(self.kinds.forwards, FixedShape):
            return [r for r in self.occupants if r is not None]
        rows = min(batch_bucket(max(r.row for r in running) + 1), len(self.occupants))
        return [r for r in self.occupants[:rows] if r is not None]

    def _plan_ahead(self, flight: Flight) -> tuple[Plan, list[Request]] | None:
        """Step n+1 where it goes on with step n's run, decided before step n is read (the host
        knows the rows a step late); else None, and the next step is planned once step n is read."""
        run = flight.run
        running = np.array([not r.done for r in run.requests])
        if not (run.steps.ahead and self._may_need_another(run.requests) and run.steps.fits_next(flight.n, running)):
            return None
        k = flight.plan.drafts  # what step n drafted for step n+1
        drafts = self._ask(run.requests)  # step n+1's head drafts for step n+2
        plan = Plan(self.kinds.choose(run.requests, k, drafts), k, drafts, run.plan.rows)
        if not plan.continues(run.plan):
            self._pipe.chosen = drafts  # the policy was asked for that step: its answer holds
            return None
        return plan, run.requests

    def _enqueue(self, planned: tuple[Plan, list[Request]] | None, ahead: bool = False) -> Flight | None:
        """Enqueues the planned step: the open run's next where it goes on, else step 0 of a new run
        from the host's view of the batch."""
        if planned is None:
            return None
        plan, requests = planned
        run = self._pipe.run
        if run is not None and run.steps.ahead and plan.continues(run.plan):
            run.n += 1
            run.steps.enqueue(run.n)
        else:
            self._close_run()
            batch = Batch(requests)
            batch.park_finished(self.max_length - self.kinds.forwards.positions_used(plan.k))
            self._clock.start_run()
            run = self._pipe.run = Run(plan, self.kinds.open(plan.kind, batch, plan.k, plan.drafts), requests, batch.rows)
            run.steps.enqueue(0, batch)
        return Flight(run, run.n, plan, ahead)

    def _record(self, flight: Flight, result: StepResult, drained: bool = False) -> None:
        """What a read step did: emit each live row's tokens (with their log-probabilities where it
        asks), check positions, count, keep the head's entries, tell the policy (not of a step
        drained at a join: the GPU ran it while the host was outside the loop, so the loop's clock
        saw a fraction of its time); the hook where nothing is in flight."""
        plan, requests = flight.plan, flight.run.requests
        live = [not r.done for r in requests]
        if not any(live):
            return  # a step run past the end of every request: its tokens are dropped, it is not counted
        live_accepted = result.accepted if all(live) else result.accepted[np.array(live)]  # [live rows]
        self._count(plan, live_accepted, flight)
        generated = self.stats.generated_tokens
        if result.next_drafts is not None:
            for req, drafts in zip(requests, result.next_drafts.tolist()):
                req.next_drafts, req.draft_probs = drafts, None
        # the rows' results as Python ints, once per step: a step's host time grows with its rows
        per_row = zip(requests, live, result.first.tolist(), result.accepted.tolist(), result.tokens.tolist())
        for j, (req, is_live, first, accepted, tokens) in enumerate(per_row):
            if is_live:
                self._check_positions(req, first)
                req.last_first_position, req.last_accepted = first, accepted
                row_logprobs = result.logprobs.get(j) if result.logprobs else None
                self._emit(req, tokens[: accepted + 1], row_logprobs and row_logprobs[: accepted + 1])
        if result.hidden is not None:  # a decode: its head entries wait
            self.head.defer_step(requests, flight.run.rows, result.hidden, result.hidden_dtype, result.tokens[:, 0],
                                 result.first)
        if plan.k == 0 and self.head is not None and (plan.drafts > 0 or self.head.deferred.full):
            with self.engine.step(), self.stats.timed("commit"):  # the next step drafts, or the entries are at their bound
                self.head.catch_up_deferred(max(plan.drafts, 1))
        self.next_k = plan.drafts
        elapsed, seconds, setup = self._clock.read(flight.n, plan)
        if not drained:
            self.policy.record(StepRecord(plan.k, plan.drafts, len(requests), live_accepted,
                                          self.stats.generated_tokens - generated, elapsed, seconds, setup))
        if self.on_commit and self._pipe.flight is None:
            self.on_commit(self, Batch([r for r, was_live in zip(requests, live) if was_live]))

    def _count(self, plan: Plan, accepted: np.ndarray, flight: Flight) -> None:
        overlapped = flight.ahead or self._pipe.flight is not None  # the GPU had this step or the next queued
        if plan.k == 0:
            self.stats.record_decode_step()
            self.stats.pipelined_steps += overlapped
        else:
            self.stats.record_speculative_step(accepted, plan.k, fused=isinstance(flight.run.steps, FusedSteps))
            self.stats.pipelined_speculative_steps += overlapped

    # -- joining and leaving -----------------------------------------------------------------
    def admit(self, requests: list[Request]) -> None:
        """Prefills requests into their rows (``request.row``; a finished row is free), between
        steps. Their forwards are enqueued first, behind a step in flight (depth 1), which the GPU
        runs meanwhile: they write only their own rows, which that step runs as finished
        placeholders, after it in stream order. That step is then read out, and only then do the
        new requests reach the host's side (rows, first tokens, the MTP head's entries over their
        prompts, which wait for the next step that drafts)."""
        self._admit_prefilled(every=True)  # a row a cancelled join gave up is then written by this admit alone
        sources, copies = forks(requests)
        groups = self._prefill_groups(sources)
        forwards = [self._prefill_forward(group, copies) for group in groups]  # (ids, out) each
        self.drain()
        self._seat(requests, [(group, copies, ids, out) for group, (ids, out) in zip(groups, forwards)])

    def submit(self, requests: list[Request], guard: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
        """admit(requests), with each prompt's prefill Run on the prefill thread where the decoder
        has one (``runtime.prefill_thread``): the steps go on meanwhile, and the step after its Run
        is done seats the requests (``joining_rows`` holds their rows until then). A Run that
        fails ends its requests (finish_reason "error", ``Request.error``) and touches no row.
        guard: the context each Run holds (``PrefillThread.submit``). With no row running and no
        join waiting, nothing would go on beside the Run: the requests are admitted here and now,
        sparing the thread's hand-over and the commit's copy of the states into their rows."""
        if self._prefills is None or (not self._prefills.jobs and self.idle):
            self.admit(requests)
            return
        sources, copies = forks(requests)
        for req in sources:
            rows, ids, positions = prompt_rows([req])
            with self.engine.step(check_errors=False):
                run = self.engine.target.prefill_apart(rows, ids, positions)
            its_forks = copies.get(req.row, [])
            join = Join([req] + its_forks, {req.row: its_forks} if its_forks else {}, ids, positions)
            self._prefills.submit(run, join, guard)

    @property
    def running(self) -> list[Request]:
        """The requests the rows run, in row order."""
        return [r for r in self.occupants if r is not None and not r.done]

    @property
    def idle(self) -> bool:
        """No row runs a request."""
        return not self.running

    @property
    def joining_rows(self) -> set[int]:
        """The rows of requests submitted and not seated yet. A request cancelled meanwhile gives
        its row up at once: a later join writes it after this one's Run (joins are seated in
        submission order, and ``admit`` seats every join first)."""
        jobs = self._prefills.jobs if self._prefills is not None else []
        return {r.row for job in jobs for r in job.what.requests if not r.done}

    def _admit_prefilled(self, every: bool = False) -> None:
        """Seats the joins whose prefill Run is done, waiting for the first where no row runs
        (nothing else could go on), for all of them with every=True. A join whose requests were
        all cancelled meanwhile is dropped: no row of theirs is written."""
        if self._prefills is None or not self._prefills.jobs:
            return
        idle = self.idle
        prefilled: list[tuple[Join, Forward]] = []
        for job in self._prefills.take_done("all" if every else "first" if idle else "none"):
            join = job.what
            if all(r.done for r in join.requests):
                continue
            try:
                prefilled.append((join, job.future.result()))
            except Exception as exc:  # noqa: BLE001  (its Run wrote no row: its requests end, the rest go on)
                for req in join.requests:
                    req.fail(exc)
        if not prefilled:
            return
        self.drain()
        for join, out in prefilled:
            source = join.requests[:1]
            with self.engine.step(), self.stats.timed("prefill"):
                rows = Rows([source[0].row])
                self.engine.reset(rows)
                self.engine.target.commit_prefill(out, rows, join.positions)
                self._fork_rows(source, join.copies)
        self._seat([r for join, _ in prefilled for r in join.requests],
                   [(join.requests[:1], join.copies, join.ids, out) for join, out in prefilled])

    def _seat(self, requests: list[Request], prefilled: list[tuple]) -> None:
        """The host side of a join, nothing in flight: the requests take their rows, then each
        prefill's (group, copies, ids, out) gives them their first tokens (``_prefill_finish``),
        and a batch that had no running row learns its first step's drafts."""
        fresh = self.idle  # no row holds drafts
        requests = [r for r in requests if not r.done]  # cancelled while its prefill ran apart: its row was given up
        for req in requests:
            self.occupants[req.row] = req
        if self.head is not None and requests:
            self.head.deferred.drop_rows(Rows([r.row for r in requests]))  # a reused row's last request's
        for group, copies, ids, out in prefilled:
            self._prefill_finish(group, copies, ids, out)
        running = self.running
        if self.head is not None and fresh and running:  # the first step's drafts (none: no step follows)
            stepped = self._step_rows(running)
            self.next_k = self.policy.next_k(len(stepped), self._tail(running), fresh=self.static,
                                             sampled=sampler.mostly_samples(stepped))

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

    def _prefill_forward(self, requests: list[Request], copies: dict[int, list[Request]]):
        """The device side of a prefill: requests with prompts of one length n in consecutive rows,
        their states reset and the target over the prompts (positions 0..n-1) in one forward;
        copies: per row, the requests of the same prompt (``forks``) whose rows take copies of its
        states. Returns (ids [B, n], the forward). With a step in flight nothing waits for it (errors
        are checked when it is read)."""
        rows, ids, positions = prompt_rows(requests)
        with self.engine.step(check_errors=self._pipe.flight is None), self.stats.timed("prefill"):
            self.engine.reset(rows)
            out = self.engine.target.prefill(rows, ids, positions, read=False)  # read in _prefill_finish
            self._fork_rows(requests, copies)
        return ids, out

    def _fork_rows(self, requests: list[Request], copies: dict[int, list[Request]]) -> None:
        """The rows of each request's forks take copies of its states (after its prefill)."""
        for req in requests:
            if req.row in copies:
                self.engine.target.fork(req.row, Rows([f.row for f in copies[req.row]]))

    def _prefill_finish(self, requests: list[Request], copies: dict[int, list[Request]], ids: np.ndarray,
                        out) -> None:
        """The host side of a prefill (``_prefill_forward``'s ids [B, n] and out): each first token
        (the forks' from the same logits), its log-probabilities where asked, the MTP head's entries
        0..n-1 deferred."""
        n = ids.shape[1]
        with self.engine.step(), self.stats.timed("prefill"):
            out.read()
            forked = [(j, f) for j, req in enumerate(requests) for f in copies.get(req.row, [])]
            source = list(range(len(requests))) + [j for j, _ in forked]  # each request's row of out
            requests = requests + [f for _, f in forked]
            for req in requests:
                req.tokens = list(req.prompt)
            last = np.full(len(ids), out.tokens.shape[1] - 1, np.int64)  # the prompt's last row: a prefill's one
            target = self.engine.target
            on_device = (lambda inputs: target.sample_last_rows(out, inputs)) if target.samples_last_rows(out) else None
            first = sampler.pick(requests, out, last, source, on_device)  # [R]
            first_logprobs = logprobs.of_forward(requests, out, first[:, None], last, source) or {}
            if self.head is not None:
                next_ids = np.concatenate([ids[source, 1:], first[:, None]], axis=1)  # x_{p+1} for every p  [R, n]
                self.head.defer_prompts(requests, Rows([r.row for r in requests]), out["hidden"], next_ids, source)
        for j, (req, token) in enumerate(zip(requests, first)):
            if req.done:  # cancelled while its prefill ran on the prefill thread: its row is free
                continue
            req.extend([token], first_logprobs.get(j))
            if not req.placeholder:
                self.stats.requests += 1
                self.stats.prompt_tokens += n
                self.stats.generated_tokens += 1

    def drain(self) -> None:
        """Reads the step in flight (its tokens are emitted) and closes the open run."""
        with self._clock.inside():
            while self._pipe.flight is not None:
                flight, self._pipe.flight = self._pipe.flight, None
                self._record(flight, flight.run.steps.read(flight.n), drained=True)
            self._close_run()

    def _close_run(self) -> None:
        run, self._pipe.run = self._pipe.run, None
        if run is not None:
            run.steps.close()

    def close(self) -> None:
        """Drops the step in flight, unread (a caller that stops or failed wants none of it), and
        closes the open run: its device work done, its page-locked memory freed; waits for the
        prefill thread's Runs and drops them."""
        self._pipe.flight = None
        self._close_run()
        if self._prefills is not None:
            self._prefills.close()

    @contextlib.contextmanager
    def scripted_k(self, script: KScript):
        """The steps meanwhile take their k from the script, whatever the policy, which sees none of
        them (a warm-up's: they run each k and switch a server's requests may run, and measure nothing)."""
        policy, self.policy = self.policy, script
        try:
            yield
        finally:
            self.policy = policy

    # -- a generate call ---------------------------------------------------------------------
    def generate(self, requests: list[Request]) -> list[list[int]]:
        for _ in self.steps(requests):
            pass
        return [r.output() for r in requests]

    def steps(self, requests: list[Request]):
        """A static batch: admits the requests (rows in order), then steps until all are done,
        yielding after the prefill and after every step (a caller streams each request's new
        tokens). Auto k weighs the batch's tail, and the call calibrates it at its end."""
        self.static = True
        try:
            self.admit(requests)
            tail = self._tail(requests) if self.head is not None else None  # where the call's steps start
            yield
            while self.step():
                yield
            if tail is not None:
                self.policy.end_call(len(requests), self.stats.steps_by_k, tail)
        finally:
            self.close()

    # -- bookkeeping -------------------------------------------------------------------------
    def _ask(self, requests: list[Request]) -> int:
        """The policy's k for the step after the one being planned (0 without a head), over the
        rows the step runs: a step's cost and what its drafts gain depend on them (on the CPU, the
        running rows; on CUDA, a graph bucket), and on whether its rows sample."""
        if self.head is None:
            return 0
        return self.policy.next_k(len(requests), self._tail(requests), sampled=sampler.mostly_samples(requests))

    def _tail(self, requests: list[Request]) -> Tail | None:
        """A generate call's tail (its slowest request sets the steps); none in a batcher, whose rows are refilled."""
        return Tail.of(requests) if self.static else None

    @staticmethod
    def _may_need_another(requests: list[Request]) -> bool:
        """Whether a step after the one in flight can matter: a running request will not have
        reached its budget with that step's tokens (at least one; a stop token is not known yet)."""
        return any(not r.done and r.output_length + 1 < r.max_new_tokens for r in requests)

    def _check_positions(self, req: Request, first: int) -> None:
        """The last accept length again, from positions: this step's first position minus the last
        step's, less the bonus token; and this step's first position against the tokens emitted.
        The states follow positions, so on disagreement positions win; the counter exposes the bug."""
        if first != req.processed or (req.last_first_position is not None and
                                      req.processed - req.last_first_position - 1 != req.last_accepted):
            self.stats.position_mismatches += 1

    def _emit(self, req: Request, tokens, token_logprobs=None) -> None:
        before = req.output_length
        req.extend(tokens, token_logprobs)
        self.stats.generated_tokens += req.output_length - before


class StepClock:
    """Each read step's seconds for the k policy: the time spent inside the loop since the last
    read (the caller's time between calls is no step's), or None where the step is not steady: at
    depth 1 the first of a run (it holds the run's start), one whose k differs from the last
    step's or the next's, or one where a CUDA graph was set up since the read before the last (a
    first run or capture waits for the GPU, which then has no step queued)."""

    def __init__(self, graphs: GraphSet, depth: int) -> None:
        self.slots, self.depth = graphs.slots, depth
        self._inside = 0.0  # seconds inside the loop in calls that have returned
        self._since: float | None = None  # when the call now running entered
        self._depth = 0  # calls into the loop now running (re-entered ones too)
        self._last_read: float | None = None  # the loop's time at the last read
        self._setups = collections.deque(maxlen=3)  # graph set-up counts at the last three reads
        self._last_k: int | None = None

    def inside(self) -> "StepClock":
        """``with clock.inside():`` around each call into the loop (re-entered calls count once)."""
        return self

    def __enter__(self) -> None:
        self._depth += 1
        if self._depth == 1:
            self._since = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._inside += time.perf_counter() - self._since
            self._since = None

    def start_run(self) -> None:
        """A run opens (before its step 0 is enqueued)."""
        self._setups.append(self.slots.setup_runs)

    def read(self, n: int, plan: Plan) -> tuple[float, float | None, bool]:
        """Step n of the open run was just read: (its seconds, those seconds where steady else None,
        whether a CUDA graph was set up since the last read)."""
        now = self._inside + (time.perf_counter() - self._since if self._since is not None else 0.0)
        setup = bool(self._setups) and self._setups[-1] != self.slots.setup_runs
        self._setups.append(self.slots.setup_runs)
        steady = (n >= 1 or not self.depth) and self._last_k == plan.k == plan.drafts and \
            self._setups[0] == self._setups[-1] and self._last_read is not None
        elapsed = now - self._last_read if self._last_read is not None else 0.0
        self._last_read, self._last_k = now, plan.k
        return elapsed, elapsed if steady else None, setup


def pads_prompts(graphs: GraphSet) -> bool:
    """Whether the head may catch up over prompts of different lengths in one run, padded
    (``DeferredEntries.take_prompts``): on CUDA (states there match a plain decode within a
    tolerance), and on the CPU with float32 activations, where each row keeps its own bits
    (float16 activations do not: ``deferred_entries``)."""
    return graphs.arrays.device != "cpu" or graphs.manifest.activations == "float32"


def prefills_apart(graphs: GraphSet, depth: int) -> bool:
    """Whether ``submit`` runs prefills on their own thread by default: on CUDA at depth 1, where the
    GPU runs one thing at a time and what a join costs the loop is the host's launches. Not on the
    CPU: there a long prompt's join stops stalling the running requests, but short prompts through
    the server measured slower apart, and where the two Runs share cores the joining request's
    first token comes later (BENCHMARKS.md, "Session 19: a long prompt's join on the CPU");
    ``Session(prefill_thread=True)`` or a batcher's ``background_prefill=True`` asks for it."""
    return graphs.arrays.device != "cpu" and depth == 1


def prompt_rows(requests: list[Request]) -> tuple[Rows, np.ndarray, np.ndarray]:
    """(rows, ids [B, n], positions [B, n]) of requests with prompts of one length n."""
    n = len(requests[0].prompt)
    ids = np.array([r.prompt for r in requests], np.int64)
    return Rows([r.row for r in requests]), ids, np.tile(np.arange(n, dtype=np.int64), (len(requests), 1))


def forks(requests: list[Request]) -> tuple[list[Request], dict[int, list[Request]]]:
    """(the requests to prefill, {row: the later requests of its prompt}): a prompt asked for
    several times at once (an API request's n choices) is prefilled once, and the other rows start
    from copies of its states (``TargetModel.fork``), bit for bit what their own prefill makes."""
    sources: dict[tuple, Request] = {}
    copies: dict[int, list[Request]] = {}
    for req in requests:
        first = sources.setdefault(tuple(req.prompt), req) if not req.placeholder else req
        if first is not req:
            copies.setdefault(first.row, []).append(req)
    copied = {id(r) for group in copies.values() for r in group}
    return [r for r in requests if id(r) not in copied], copies

