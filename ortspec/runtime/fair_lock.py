"""A re-entrant lock granted in arrival order: how callers' steps take turns on one device.

``threading.RLock`` is not fair: a thread that releases it and asks again at once usually
gets it back before a waiting thread wakes up, so one generate call could run all its steps
while a batcher on another engine waits. ``FairLock`` serves tickets in order, so with several
callers each waits for at most one step of every other: their steps interleave one by one.
"""

from __future__ import annotations

import threading


class FairLock:
    def __init__(self) -> None:
        self._condition = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0  # re-entries by the owner
        self._next_ticket = 0
        self._serving = 0  # the ticket whose holder may take the lock

    def acquire(self) -> None:
        me = threading.get_ident()
        with self._condition:
            if self._owner == me:
                self._depth += 1
                return
            ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
            while self._serving != ticket:
                self._condition.wait()
            self._owner, self._depth = me, 1

    def release(self) -> None:
        with self._condition:
            if self._owner != threading.get_ident():
                raise RuntimeError("FairLock released by a thread that does not hold it")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._serving += 1
                self._condition.notify_all()

    def __enter__(self) -> "FairLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
