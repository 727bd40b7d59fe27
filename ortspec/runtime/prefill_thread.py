"""A thread for prefill Runs, beside the thread that runs the steps.

A join's prefill runs eagerly: ONNX Runtime launches its graph node by node, which holds the
host for milliseconds whatever the prompt's length, and a loop that enqueues a step ahead of the
GPU enqueues nothing meanwhile. Here that Run goes on while the steps go on. It is safe because
such a Run (``TargetModel.prefill_apart``) reads only weights and zero states made for it and
writes only its own outputs: the rows it will fill are written on the steps' thread, by
``TargetModel.commit_prefill``, once the request is admitted.

Every job holds ``CAPTURE_LOCK``: while ONNX Runtime captures a CUDA graph (in the global capture
mode) no other thread of the process may launch, allocate or synchronise on the device.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from typing import Callable, ContextManager

from .graph_slots import CAPTURE_LOCK


class PrefillThread:
    """One worker thread, started at the first job and stopped by ``close()`` (idempotent; a later
    job starts it again). Jobs run in submission order."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def submit(self, run: Callable[[], object],
               guard: Callable[[], ContextManager] = contextlib.nullcontext) -> concurrent.futures.Future:
        """run() on the thread, inside guard() (a batcher's: the lease's ``using``, so that
        Session.close() waits for the job and a job after it raises ClosedError, touching nothing)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ortspec-prefill")
        return self._pool.submit(_job, run, guard)

    def close(self) -> None:
        """Waits for the jobs submitted, then stops the thread."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _job(run: Callable[[], object], guard: Callable[[], ContextManager]):
    with guard(), CAPTURE_LOCK:
        return run()
