"""The engine thread: one continuous batcher over the Session, driven by one thread.

HTTP handlers never touch the Session's state: they ``submit`` a ``Job`` (its prompt already
checked and tokenized) and read the events the thread hands them. Each turn the thread

    1. ends what must end: cancelled jobs (the client went away) and jobs past their deadline
       (batcher.cancel frees the row at once); a queued job past its deadline fails with 503;
    2. admits queued jobs into free rows (add_request prefills: the first token);
    3. steps the batcher once and gives every job the tokens step() reported, and its finish
       reason when it is done.

The queue is bounded: ``submit`` raises ``QueueFull`` (HTTP 429) when max_queue jobs wait.
Events reach a job through ``job.deliver`` (the handler posts them into its event loop):
``Tokens(ids)``, ``Finished(reason)`` ("stop", "length", "timeout"; the last event) or
``Failed(status, message)`` (the last event).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable

from ..errors import OrtspecError
from ..speculative.sampling import SamplingParams

RATE_WINDOW = 10.0  # seconds of steps the tokens/s gauge averages over


class QueueFull(Exception):
    """Every queue slot is taken (HTTP 429)."""


@dataclasses.dataclass
class Tokens:
    ids: list[int]


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
    request_id: int | None = None  # the batcher's id once admitted
    sent: int = 0  # tokens delivered


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

    def tokens_per_second(self, now: float) -> float:
        return sum(n for t, n in list(self.recent) if t >= now - RATE_WINDOW) / RATE_WINDOW


class Engine:
    def __init__(self, session, max_batch_size: int, max_queue: int) -> None:
        self.session, self.max_batch_size, self.max_queue = session, max_batch_size, max_queue
        self.metrics = Metrics()
        self.error: str | None = None  # set when the thread died of an unexpected error
        self._queue: collections.deque[Job] = collections.deque()
        self._running: dict[int, Job] = {}  # request id -> job
        self._cancelled: list[Job] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ortspec-engine", daemon=True)
        self._started = threading.Event()

    # -- any thread ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._started.wait()

    def submit(self, job: Job) -> None:
        with self._wake:
            if self._stopping or self.error:
                raise QueueFull("the server is shutting down" if self._stopping else f"the engine failed: {self.error}")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"all {self.max_queue} queue slots are taken ({len(self._running)} requests running); "
                                "retry later.")
            self._queue.append(job)
            self._wake.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: the job ends at the engine's next turn, freeing its row."""
        with self._wake:
            self._cancelled.append(job)
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
        return len(self._running)

    # -- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with self.session.batcher(max_batch_size=self.max_batch_size) as batcher:
                self._started.set()
                while self._turn(batcher):
                    pass
        except Exception as exc:  # noqa: BLE001  (reported to every waiting client and on /health)
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._started.set()
            self._fail_all(503 if self.error is None else 500,
                           "the server is shutting down" if self.error is None else f"the engine failed: {self.error}")

    def _turn(self, batcher) -> bool:
        with self._wake:
            while not (self._stopping or self._queue or self._running or self._cancelled):
                self._wake.wait()
            if self._stopping:
                return False
            cancelled, self._cancelled = self._cancelled, []
        now = time.monotonic()
        self._end(batcher, cancelled, now)
        self._admit(batcher, now)
        if self._running:
            report = batcher.step()
            self.metrics.record_step(sum(map(len, report.values())), time.monotonic())
            for rid, tokens in report.items():
                self._deliver(batcher, rid, tokens)
        return True

    def _end(self, batcher, cancelled: list[Job], now: float) -> None:
        for job in cancelled:
            if job.request_id is None:
                if self._drop_queued(job):
                    self.metrics.finished["cancelled"] += 1
            elif self._running.pop(job.request_id, None) is job:
                batcher.cancel(job.request_id)
                self.metrics.finished["cancelled"] += 1
        for rid, job in list(self._running.items()):
            if now > job.deadline:
                job.deliver(Tokens(batcher.result(rid)[job.sent:]))
                batcher.cancel(rid)
                self._finish(rid, "timeout")
        for job in [j for j in self._queue if now > j.deadline]:
            self._drop_queued(job)
            job.deliver(Failed(503, "timed out waiting for a free row; retry later or raise the timeout."))
            self.metrics.finished[503] += 1

    def _drop_queued(self, job: Job) -> bool:
        """Takes the job out of the queue; False when it was not there (admitted or ended)."""
        with self._wake:
            if job in self._queue:
                self._queue.remove(job)
                return True
            return False

    def _admit(self, batcher, now: float) -> None:
        while len(self._running) < self.max_batch_size:
            with self._wake:
                if not self._queue:
                    return
                job = self._queue.popleft()
            try:
                sampling = job.sampling  # min_p is not a request argument (yet): validation leaves it 0
                job.request_id = batcher.add_request(job.prompt, max_new_tokens=job.max_tokens,
                                                     temperature=sampling.temperature, top_k=sampling.top_k,
                                                     top_p=sampling.top_p, seed=sampling.seed)
            except OrtspecError as exc:  # checked by the handler already; a race with max_length etc.
                job.deliver(Failed(400, str(exc)))
                self.metrics.finished[400] += 1
                continue
            self._running[job.request_id] = job
            self.metrics.admitted += 1
            self.metrics.prompt_tokens += len(job.prompt)

    def _deliver(self, batcher, rid: int, tokens: list[int]) -> None:
        job = self._running.get(rid)
        if job is None:
            return
        if tokens:
            job.sent += len(tokens)
            job.deliver(Tokens(tokens))
        reason = batcher.finish_reason(rid)
        if reason is not None:
            self._finish(rid, reason)

    def _finish(self, rid: int, reason: str) -> None:
        job = self._running.pop(rid)
        job.deliver(Finished(reason))
        self.metrics.finished[reason] += 1

    def _fail_all(self, status: int, message: str) -> None:
        with self._wake:
            jobs, self._queue = list(self._queue) + list(self._running.values()), collections.deque()
            self._running = {}
        for job in jobs:
            job.deliver(Failed(status, message))
