"""Engines: the state buffers of one batch size, and who holds them.

An ``Engine`` is the target's and the MTP head's states for B rows. It belongs to one caller
at a time: a running ``generate`` call or an open batcher leases it from the Session's
``EnginePool`` and gives it back when done (a generate call at its end, also on an exception;
a batcher at close() or when it is garbage-collected). Two callers never share buffers, so
they cannot corrupt each other's states; on CUDA the captured graphs are keyed by engine
(``graph_slots.SlotKey``), so each engine replays its own.

Policy when many callers arrive (``EnginePool.lease``): take a free engine of that batch size;
else make a new one while fewer than ``max_per_batch`` exist; else wait until one is given
back. Waiting is refused (``EnginesHeldError``) when every engine of that size is held by the
asking thread itself, e.g. an open batcher and a generate call of the same size in one thread
at a cap of 1: no other thread could ever give one back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Callable

from ..errors import ClosedError, EnginesHeldError
from .graphs import GraphSet
from .model import MTPHead, TargetModel


@dataclasses.dataclass(eq=False)
class Engine:
    """State buffers for ``batch`` rows: the target's (KV, GDN conv and recurrent) and the MTP head's."""

    id: int  # the engine's CUDA-graph slots are keyed by it
    batch: int
    target: TargetModel
    mtp: MTPHead | None  # None when k = 0

    @classmethod
    def create(cls, graphs: GraphSet, batch: int, k: int, stages: int = 1) -> "Engine":
        with graphs.device_lock:  # CUDA: allocates from the device's buffer pool, shared by every engine
            engine_id = graphs.slots.new_engine_id()
            return cls(engine_id, batch, TargetModel(graphs, batch, stages, engine_id),
                       MTPHead(graphs, batch, k, engine_id) if k else None)

    @property
    def arrays(self):
        return self.target.graphs.arrays

    @contextlib.contextmanager
    def step(self, check_errors: bool = True):
        """Holds the device for one step's or prefill's work done from the host: the device lock
        (on CUDA every caller's steps take turns) and a fresh step scratch, after reporting any
        index error a kernel recorded (which waits for the GPU; check_errors=False: work enqueued
        behind a step in flight, whose read checks). The loops whose control stays on the device
        take it themselves (``decode_run``, ``fused_run``)."""
        graphs = self.target.graphs
        with graphs.device_lock:
            graphs.begin_step(check_errors)
            yield

    def reset(self, rows) -> None:
        """New sequences start in these rows (``runtime.states.Rows``, contiguous): the target's GDN
        states zeroed, every KV entry of theirs dead."""
        self.target.reset(rows)
        if self.mtp is not None:
            self.mtp.reset(rows)

    def release(self) -> None:
        """Drops the buffers (Session.close); a stale holder keeps an empty shell."""
        self.target.release()
        if self.mtp is not None:
            self.mtp.release()


class Lease:
    """One engine, held by one caller until ``release()`` (idempotent).

    ``with pool.lease(b) as engine:`` holds it for the block and gives it back after (a generate
    call). A batcher keeps the lease and wraps each of its calls in ``using()``; Session.close()
    waits for calls inside ``using()`` to end, then revokes every lease.
    """

    def __init__(self, pool: "EnginePool", engine: Engine) -> None:
        self._pool, self._engine = pool, engine
        self.batch = engine.batch
        self.thread = threading.get_ident()  # the holder, for the self-deadlock check
        self.users: list[int] = []  # threads inside using() now

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise ClosedError("this engine lease was released (given back, or revoked by Session.close()).")
        return self._engine

    @contextlib.contextmanager
    def using(self):
        """Marks a call in flight on the engine (Session.close() waits for it); yields the engine."""
        with self._pool.condition:
            self._pool.check_open()
            engine = self.engine
            self.users.append(threading.get_ident())
        try:
            yield engine
        finally:
            with self._pool.condition:
                self.users.remove(threading.get_ident())
                self._pool.condition.notify_all()

    def release(self) -> None:
        self._pool.give_back(self)

    def __enter__(self) -> Engine:
        self._use = self.using()
        try:
            return self._use.__enter__()
        except BaseException:  # e.g. the Session closed meanwhile: the lease must not linger
            self.release()
            raise

    def __exit__(self, *exc) -> None:
        try:
            self._use.__exit__(*exc)
        finally:
            self.release()


class EnginePool:
    """Engines per batch size, leased to one caller at a time (policy: the module docstring).

    The condition's lock is re-entrant: a batcher dropped unclosed gives its engine back from a
    garbage-collection finalizer, which may run on a thread that is inside the pool already.
    """

    def __init__(self, make_engine: Callable[[int], Engine], max_per_batch: int) -> None:
        self.make_engine, self.max_per_batch = make_engine, max_per_batch
        self.condition = threading.Condition(threading.RLock())
        self._free: dict[int, list[Engine]] = {}
        self._leases: dict[int, list[Lease]] = {}
        self._made: dict[int, int] = {}  # engines made or being made, per batch size
        self._waiting: dict[int, int] = {}
        self._closed = False

    def lease(self, batch: int) -> Lease:
        with self.condition:
            while not self._free.get(batch) and self._made.get(batch, 0) >= self.max_per_batch:
                self._wait_for(batch)
            self.check_open()
            if self._free.get(batch):
                return self._hand_out(self._free[batch].pop())
            self._made[batch] = self._made.get(batch, 0) + 1
        try:
            engine = self.make_engine(batch)  # outside the lock: other sizes need not wait for the allocation
        except BaseException:
            with self.condition:
                if not self._closed:  # close() forgot every count
                    self._made[batch] -= 1
                self.condition.notify_all()
            raise
        with self.condition:
            if self._closed:
                engine.release()
                self.check_open()
            return self._hand_out(engine)

    def _wait_for(self, batch: int) -> None:
        self.check_open()
        me = threading.get_ident()
        held = self._leases.get(batch, [])
        if len(held) == self._made[batch] and all(lease.thread == me for lease in held):
            raise EnginesHeldError(
                f"all {len(held)} engines (state buffers) for batch size {batch} are held by this thread "
                "(an open batcher, or a generate call further up its stack), so waiting for one would never "
                "end. Close a batcher first (batcher.close(), or open it in a with block), or create the "
                f"Session with max_engines_per_batch_size > {self.max_per_batch}."
            )
        self._waiting[batch] = self._waiting.get(batch, 0) + 1
        try:
            self.condition.wait()
        finally:
            self._waiting[batch] -= 1

    def _hand_out(self, engine: Engine) -> Lease:
        lease = Lease(self, engine)
        self._leases.setdefault(engine.batch, []).append(lease)
        return lease

    def give_back(self, lease: Lease) -> None:
        with self.condition:
            if lease._engine is None:
                return  # released before, or revoked by close()
            engine, lease._engine = lease._engine, None
            self._leases[lease.batch].remove(lease)
            self._free.setdefault(lease.batch, []).append(engine)
            self.condition.notify_all()

    def close(self) -> None:
        """Refuses new leases, waits for calls in flight (inside ``using()``) to end, then revokes
        every lease (an open batcher's next call raises ClosedError) and drops every engine's
        buffers. Refused when the closing thread is itself inside such a call (a callback)."""
        with self.condition:
            if any(threading.get_ident() in lease.users for lease in self._all_leases()):
                raise EnginesHeldError("Session.close() was called from inside one of its own calls "
                                       "(a callback?); close it after that call returns.")
            self._closed = True
            self.condition.notify_all()  # waiters wake up and raise ClosedError
            while any(lease.users for lease in self._all_leases()):
                self.condition.wait()
            for lease in self._all_leases():
                lease._engine.release()
                lease._engine = None
            for engine in [engine for engines in self._free.values() for engine in engines]:
                engine.release()
            self._leases.clear()
            self._free.clear()
            self._made.clear()

    def _all_leases(self) -> list[Lease]:
        return [lease for leases in self._leases.values() for lease in leases]

    def census(self) -> dict[int, dict[str, int]]:
        """Per batch size: engines made, leased now, callers waiting."""
        with self.condition:
            return {batch: {"engines": made, "leased": len(self._leases.get(batch, [])),
                            "waiting": self._waiting.get(batch, 0)} for batch, made in sorted(self._made.items())}

    def check_open(self) -> None:
        if self._closed:
            raise ClosedError("this Session is closed (Session.close()); open a new Session.")
