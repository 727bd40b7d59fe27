"""A thread for prefill Runs, beside the thread that runs the steps.

A join's prefill runs eagerly: ONNX Runtime launches its graph node by node, which holds the
host for milliseconds whatever the prompt's length, and a loop that enqueues a step ahead of the
GPU enqueues nothing meanwhile. Here that Run goes on while the steps go on. It is safe because
such a Run (``TargetModel.prefill_apart``) writes only its own outputs and reads nothing a step
writes that it uses (zero GDN states made for it; KV caches whose contents a fresh prompt never
uses): the rows it will fill are written on the steps' thread, by ``TargetModel.commit_prefill``,
once the request is admitted.

Every job holds ``CAPTURE_LOCK``: while ONNX Runtime captures a CUDA graph (in the global capture
mode) no other thread of the process may launch, allocate or synchronise on the device.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
from typing import Callable, ContextManager

from .graph_slots import CAPTURE_LOCK


@dataclasses.dataclass(eq=False)
class Job:
    """A Run submitted: the caller's record of what it is for, and its future result."""

    what: object
    future: concurrent.futures.Future


class PrefillThread:
    """One worker thread, started at the first job and stopped by ``close()`` (idempotent; a later
    job starts it again). Jobs run in submission order; ``jobs`` holds those not taken yet."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.jobs: list[Job] = []

    def submit(self, run: Callable[[], object], what: object,
               guard: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
        """run() on the thread, inside guard() (a batcher's: the lease's ``using``, so that
        Session.close() waits for the job and a job after it raises ClosedError, touching nothing)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ortspec-prefill")
        self.jobs.append(Job(what, self._pool.submit(_job, run, guard)))

    def take_done(self, wait: str = "none") -> list[Job]:
        """The jobs done, in submission order, taken out of ``jobs``; wait "first" or "all": for
        the first or every job first."""
        if wait != "none" and self.jobs:
            concurrent.futures.wait([job.future for job in (self.jobs if wait == "all" else self.jobs[:1])])
        done = [job for job in self.jobs if job.future.done()]
        self.jobs = [job for job in self.jobs if job not in done]
        return done

    def close(self) -> None:
        """Waits for the jobs submitted, drops them, then stops the thread."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self.jobs = []


def _job(run: Callable[[], object], guard: Callable[[], ContextManager]):
    with guard(), CAPTURE_LOCK:
        return run()
