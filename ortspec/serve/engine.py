"""The engine thread: one continuous batcher over the Session, driven by one thread.

HTTP handlers never touch the Session's state: they ``submit`` a ``Job`` (its prompt already
checked and tokenized) and read the events the thread hands them. Each turn the thread

    1. ends what must end: cancelled jobs (the client went away) and running jobs past their
       deadline (batcher.cancel frees the row at once); a queued job past its deadline fails
       with 503 when no row is free for it this turn (with one free, it is admitted: every
       admitted request gets at least its first token);
    2. admits queued jobs into free rows (add_requests(wait=False): on CUDA their prefills run on
       a thread of their own while the steps go on, and a later step seats them with their first
       token; on the CPU they are prefilled at once and the first token is sent at once);
    3. steps the batcher once and gives every job the tokens step() reported, and its finish
       reason when it is done (a prefill that failed on its thread: that job alone gets 500).

Every job that leaves the queue is answered once: finished, failed, or (cancelled: nobody
listens) dropped with Finished("cancelled"). What goes wrong: a request the batcher refuses gets 400; anything unexpected
while admitting one request fails that request alone with 500 (add_request is atomic), its
traceback logged under its id; an unexpected error in the rest of a turn (a step) fails the
running requests with 500, and the thread closes its batcher and opens a new one (half-
committed states are never stepped again), then goes on. Only a batcher that cannot be opened
stops the thread: every waiting job then fails, and /health answers 503.

The queue is bounded: ``submit`` raises ``QueueFull`` (HTTP 429) when max_queue jobs wait, and
``Unavailable`` (503) when no engine takes jobs
(a request of n choices submits n jobs, all or none); Metrics.finished counts refused jobs
under their status, as it counts failed ones. Events reach a job through
``job.deliver`` (the handler posts them into its event loop): ``Tokens(ids, logprobs)``,
``Finished(reason)`` ("stop", "length", "timeout"; the last event) or ``Failed(status,
message)`` (the last event). A job's stop strings end its request in the loop, at the token
that completes one (``Request.extend``), which frees its row there and then.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Callable

from ..errors import OrtspecError
from ..speculative.sampling import SamplingParams

RATE_WINDOW = 10.0  # seconds of steps the tokens/s gauge averages over
log = logging.getLogger("ortspec.serve")


def internal_error(request_id: str) -> str:
    """The 500 message: not the request's fault; where to look."""
    return (f"internal error while serving request {request_id}; the server log has its traceback under this id. "
            "The server goes on serving: retry the request.")


class QueueFull(Exception):
    """Every queue slot is taken (HTTP 429)."""

    status = 429


class Unavailable(QueueFull):
    """No engine takes jobs: the server is stopping, the engine failed, or (engine_process) its
    process is being replaced (HTTP 503)."""

    status = 503


def refusal(stopping: bool, error: str | None, max_queue: int, queued: int, jobs: int, running: int) -> QueueFull | None:
    """Why a submit of `jobs` jobs is refused (Unavailable, QueueFull), or None: what the engine
    thread and the engine process (engine_process.py) answer alike."""
    if stopping or error:
        return Unavailable("the server is shutting down; send the request to another server, or retry once it is "
                           "back." if stopping else f"the engine is not serving ({error}); retry once GET /health "
                           "answers 200.")
    if queued + jobs <= max_queue:
        return None
    free = max_queue - queued
    taken = (f"all {max_queue} queue slots are taken" if free <= 0 else
             f"{free} of {max_queue} queue slots are free, for {jobs} choices")
    return QueueFull(f"{taken} ({running} request{'s' if running != 1 else ''} running); retry later.")


@dataclasses.dataclass
class Tokens:
    ids: list[int]
    logprobs: list | None = None  # their TokenLogprob entries, for a job that asks


@dataclasses.dataclass
class Finished:
    reason: str


@dataclasses.dataclass
class Failed:
    status: int
    message: str


@dataclasses.dataclass(eq=False)
class Job:
    """One request for the engine: checked token ids, how many to make, how, and until when."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    deadline: float  # time.monotonic() after which it is stopped
    deliver: Callable[[object], None]  # called on the engine thread with each event
    id: str = "-"  # the response's id, in log lines and 500 messages
    stop: tuple[str, ...] = ()  # stop strings
    logprobs: int | None = None  # alternatives per token's log-probability (None: none)
    seed_index: int = 0  # the random stream of the seed it draws from (choice i: i)
    ignore_eos: bool = False  # the model's stop tokens do not end it (max_tokens, or a stop string, does)
    request_id: int | None = None  # the batcher's id once admitted
    sent: int = 0  # tokens delivered
    cancelled: bool = False  # the client went away (set by Engine.cancel, any thread)


class Metrics:
    """Counters the engine thread writes and /metrics reads (ints and a deque: no torn reads that matter)."""

    def __init__(self) -> None:
        self.admitted = self.generated = self.prompt_tokens = 0
        self.finished: collections.Counter = collections.Counter()  # reason / status -> requests
        self.recent: collections.deque = collections.deque()  # (time, tokens) per step, RATE_WINDOW long

    def record_step(self, tokens: int, now: float) -> None:
        self.generated += tokens
        self.recent.append((now, tokens))
        while self.recent and self.recent[0][0] < now - RATE_WINDOW:
            self.recent.popleft()

    def refused(self, refusal: QueueFull, jobs: int) -> QueueFull:
        """Counts a submit's jobs refused (429, 503) under their status, as failed jobs are; returns the refusal."""
        self.finished[refusal.status] += jobs
        return refusal

    def tokens_per_second(self, now: float) -> float:
        return sum(n for t, n in list(self.recent) if t >= now - RATE_WINDOW) / RATE_WINDOW


class Engine:
    def __init__(self, session, max_batch_size: int, max_queue: int, flush: Callable[[], None] | None = None) -> None:
        self.session, self.max_batch_size, self.max_queue = session, max_batch_size, max_queue
        self.flush = flush  # called on the engine thread once events are out: after admissions and each turn
        # (engine_process: sends them to the parent)
        self.metrics = Metrics()
        self.error: str | None = None  # set when the thread died of an unexpected error
        self.batcher = None  # the engine thread's; replaced after a failed turn
        self._queue: collections.deque[Job] = collections.deque()
        self._running: dict[int, Job] = {}  # request id -> job
        self._admitting: list[Job] = []  # out of the queue, inside add_requests
        self._cancels = False  # a cancel arrived since the last turn began
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ortspec-engine", daemon=True)
        self._started = threading.Event()

    # -- any thread ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._started.wait()

    def submit(self, *jobs: Job) -> None:
        """Queues the jobs (a request's choices), all of them or none."""
        with self._wake:
            refused = refusal(self._stopping, self.error, self.max_queue, len(self._queue), len(jobs), self.running)
            if refused is not None:
                raise self.metrics.refused(refused, len(jobs))
            self._queue.extend(jobs)
            self._wake.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: the job ends at the engine's next turn, freeing its row."""
        with self._wake:
            job.cancelled = self._cancels = True
            self._wake.notify()

    def stop(self) -> None:
        """Fails waiting and running jobs with 503, closes the batcher, joins the thread."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        """Requests out of the queue and not yet answered: holding a row, or being admitted."""
        return len(self._running) + len(self._admitting)

    # -- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.batcher = self.session.batcher(max_batch_size=self.max_batch_size)
            self.batcher.warm_up()  # every graph and k its requests may run (CUDA: every batch bucket), before one waits
            self._started.set()
            while self._turn():
                pass
        except Exception as exc:  # noqa: BLE001  (reported to every waiting client and on /health)
            log.exception("the engine thread stopped")
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._started.set()
            self._fail_all(503 if self.error is None else 500,
                           "the server is shutting down" if self.error is None else f"the engine failed: {self.error}")
            if self.batcher is not None:
                self.batcher.close()

    def _turn(self) -> bool:
        with self._wake:
            while not (self._stopping or self._queue or self._running or self._cancels):
                self._wake.wait()
            if self._stopping:
                return False
            self._cancels = False
        try:
            self._end(time.monotonic())
            if self._admit() and self.flush is not None:
                self.flush()  # the first tokens go out before the step
            if self._running:
                self._step()
        except Exception:  # noqa: BLE001  (the batcher's states may be half-committed: start afresh)
            self._recover()
        if self.flush is not None:
            self.flush()
        return True

    def _end(self, now: float) -> None:
        for rid, job in list(self._running.items()):
            if job.cancelled:
                del self._running[rid]
                self.batcher.cancel(rid)
                self.batcher.forget(rid)
                self._drop(job)
            elif now > job.deadline:
                self._send(rid, job, self.batcher.result(rid)[job.sent:])
                self.batcher.cancel(rid)
                self._finish(rid, "timeout")
        with self._wake:
            free = self.max_batch_size - len(self._running)  # the first `free` queued jobs get a row this turn
            for position, job in enumerate(list(self._queue)):
                if job.cancelled:
                    self._queue.remove(job)
                    self._drop(job)
                elif now > job.deadline and position >= free:
                    self._queue.remove(job)
                    self._fail(job, 503, "timed out waiting for a free row; retry later or raise the timeout.")

    def _admit(self) -> bool:
        """Admits queued jobs while rows are free; a request's choices that fit go in together
        (one prefill for all: Batcher.add_requests). Whether any job left the queue."""
        admitted = False
        while len(self._running) < self.max_batch_size:
            with self._wake:
                if not self._queue:
                    return admitted
                admitted = True
                jobs = [self._queue.popleft()]
                while (self._queue and self._queue[0].id == jobs[0].id
                       and len(self._running) + len(jobs) < self.max_batch_size):
                    jobs.append(self._queue.popleft())
                self._admitting = jobs
            self._admit_together(jobs)
            self._admitting = []
        return admitted

    def _admit_together(self, jobs: list[Job]) -> None:
        for job in jobs:
            if job.cancelled:
                self._drop(job)
        jobs = [job for job in jobs if not job.cancelled]
        if not jobs:
            return
        try:
            ids = self.batcher.add_requests([dict(
                prompt=job.prompt, max_new_tokens=job.max_tokens, stop=job.stop,
                stop_tokens=[] if job.ignore_eos else None, logprobs=job.logprobs, seed_index=job.seed_index,
                temperature=job.sampling.temperature, top_k=job.sampling.top_k, top_p=job.sampling.top_p,
                min_p=job.sampling.min_p, seed=job.sampling.seed) for job in jobs], wait=False)
        except OrtspecError as exc:  # checked by the handler already; a race with max_length etc.
            for job in jobs:
                self._fail(job, 400, str(exc))
            return
        except Exception:  # noqa: BLE001  (add_requests is atomic: these requests alone fail)
            log.exception("request %s failed while it was admitted", jobs[0].id)
            for job in jobs:
                self._fail(job, 500, internal_error(job.id))
            return
        for job, rid in zip(jobs, ids):
            job.request_id = rid
            self._running[rid] = job
            self.metrics.admitted += 1
            self.metrics.prompt_tokens += len(job.prompt)
        self._admitting = []  # running now: counted once (``running``) before any client hears of them
        self._publish(self.batcher.report())  # their first tokens now, not after the next step

    def _step(self) -> None:
        self._publish(self.batcher.step())

    def _publish(self, report: dict[int, list[int]]) -> None:
        """A step's (or an admission's) tokens to their jobs, counted."""
        self.metrics.record_step(sum(map(len, report.values())), time.monotonic())
        for rid, tokens in report.items():
            self._deliver(rid, tokens)

    def _recover(self) -> None:
        """(in an except block) Fails the jobs out of the queue with 500, then replaces the batcher."""
        jobs = list(self._running.values()) + self._admitting
        log.exception("an engine turn failed; failing the running requests %s with 500 and reopening the batcher",
                      ", ".join(job.id for job in jobs) or "(none)")
        self._running, self._admitting = {}, []
        for job in jobs:
            self._fail(job, 500, internal_error(job.id))
        try:
            self.batcher.close()
        except Exception:  # noqa: BLE001  (its engine is dropped with it)
            log.exception("closing the failed batcher failed too")
        self.batcher = self.session.batcher(max_batch_size=self.max_batch_size)

    def _deliver(self, rid: int, tokens: list[int]) -> None:
        job = self._running.get(rid)
        if job is None:
            return
        self._send(rid, job, tokens)
        reason = self.batcher.finish_reason(rid)
        if reason == "error":  # its prefill failed on the prefill thread: this request alone
            log.error("request %s failed in its prefill", job.id, exc_info=self.batcher.error(rid))
            del self._running[rid]
            self.batcher.forget(rid)
            self._fail(job, 500, internal_error(job.id))
        elif reason is not None:
            self._finish(rid, reason)

    def _send(self, rid: int, job: Job, tokens: list[int]) -> None:
        """The job's next tokens, with their log-probabilities where it asks."""
        if tokens:
            logprobs = self.batcher.logprobs(rid, job.sent)[: len(tokens)] if job.logprobs is not None else None
            job.sent += len(tokens)
            job.deliver(Tokens(tokens, logprobs))

    def _finish(self, rid: int, reason: str) -> None:
        job = self._running.pop(rid)
        job.deliver(Finished(reason))
        self.metrics.finished[reason] += 1
        self.batcher.forget(rid)  # answered: nothing of it is read again

    def _drop(self, job: Job) -> None:
        """A cancelled job's end: nobody listens, but a relay (engine_process) forgets it then."""
        job.deliver(Finished("cancelled"))
        self.metrics.finished["cancelled"] += 1

    def _fail(self, job: Job, status: int, message: str) -> None:
        job.deliver(Failed(status, message))
        self.metrics.finished[status] += 1

    def _fail_all(self, status: int, message: str) -> None:
        with self._wake:
            jobs = list(self._queue) + list(self._running.values()) + self._admitting
            self._queue, self._running, self._admitting = collections.deque(), {}, []
        for job in jobs:
            self._fail(job, status, message)
