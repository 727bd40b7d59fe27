"""One caller per state: every running generate call and every open batcher holds its own state
buffers (an engine leased from the Session's pool), so threads, batchers and generate calls on
one Session never corrupt each other. Every output is compared with the same call made alone.

Before engines were leased, all callers shared one buffer set per batch size: two threads got
78-80 of 80 outputs wrong, a generate between a batcher's steps broke the batcher from its 3rd
token, and two batchers of one size stepped alternately were both wrong (issue 10).
"""

from __future__ import annotations

import dataclasses

import gc
import threading
import time
import weakref

import pytest

import ortspec
from ortspec.runtime.engines import EnginePool, Lease
from ortspec.runtime.fair_lock import FairLock
from ortspec.runtime.graphs import GraphRunner
from ortspec.runtime.host_binding import HostBinding
from ortspec.speculative.stats import Stats

P = [[5, 17, 99, 3, 250, 7, 11], [42], [8, 8, 8, 300, 1, 2, 3, 4, 5], [1, 2], [400, 3, 3, 3], [77] * 9]


@pytest.fixture(scope="module")
def model(models):
    return models.converted("base")


@pytest.fixture(scope="module")
def sessions(model):
    """Three Sessions of different k and commit on one model directory (k is chosen per Session)."""
    return [ortspec.Session(model), ortspec.Session(model, num_speculative_tokens=3, commit="readvance",
                                                    max_engines_per_batch_size=2),
            ortspec.Session(model, num_speculative_tokens=2)]


def calls_in_rounds(threads: int, rounds: int) -> list[tuple[int, list, int]]:
    """(session, prompts, max_new_tokens) per call; call i runs in thread i % threads. In every
    round threads 0 and 1, and 2 and 3, run the same Session and batch size (so a shared buffer
    set would be written by both), with other prompts; batch sizes 1..3 and k vary by round."""
    calls = []
    for r in range(rounds):
        for t in range(threads):
            session, size = (r + t // 2) % 3, 1 + (r + t // 2) % 3
            prompts = [P[(r + 2 * t + j) % len(P)] for j in range(size)]
            calls.append((session, prompts, 10 + 2 * t))
    return calls


def wrong_in_threads(sessions, threads: int = 4, rounds: int = 3) -> list[int]:
    """Runs every call alone, then all of them from `threads` threads at once; returns the
    indices of calls whose output differs from their single-threaded output. Each call sleeps
    after every step (on_commit) so the threads interleave step by step even on a loaded machine."""
    calls = calls_in_rounds(threads, rounds)
    alone = [sessions[s].generate(p, max_new_tokens=n) for s, p, n in calls]
    results, errors, start = [None] * len(calls), [], threading.Barrier(threads)

    def worker(t):
        try:
            start.wait(timeout=30)
            for i in range(t, len(calls), threads):
                s, prompts, n = calls[i]
                results[i] = sessions[s].generate(prompts, max_new_tokens=n, on_commit=lambda d, b: time.sleep(0.003))
        except BaseException as error:  # re-raised in the test's thread
            errors.append(error)

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    if errors:
        raise errors[0]
    return [i for i in range(len(calls)) if results[i] != alone[i]]


def test_threads_get_their_single_threaded_outputs(sessions):
    """4 threads x 3 calls over 3 Sessions (k = 0, 3 readvance, 2 select), batch sizes 1..3."""
    for s in sessions:
        s.reset_stats()
    assert wrong_in_threads(sessions) == []
    calls = calls_in_rounds(4, 3)
    for index, s in enumerate(sessions):  # totals merged from every thread: each call counted once
        requests = sum(len(p) for i, p, _ in calls if i == index)
        assert s.stats["requests"] == 2 * requests and s.stats["position_mismatches"] == 0
    capped = sessions[1].stats["engines"]
    assert capped and all(c["engines"] <= 2 and c["leased"] == 0 for c in capped.values())


def test_one_engine_for_everyone_is_caught(sessions, monkeypatch):
    """Planted: a pool that hands every caller the same engine per batch size (the old shared
    buffers). The thread test must see wrong outputs."""
    shared = {}

    def one_engine_for_everyone(pool, batch):
        if (id(pool), batch) not in shared:
            shared[(id(pool), batch)] = pool.make_engine(batch)
        lease = Lease(pool, shared[(id(pool), batch)])
        lease.release = lambda: None
        return lease

    monkeypatch.setattr(EnginePool, "lease", one_engine_for_everyone)
    try:
        wrong = wrong_in_threads(sessions, rounds=2)
    except ortspec.InternalError:  # or loudly: a fused step's accept lengths checked against the host's rule
        return
    assert len(wrong) >= 2


def test_a_batcher_interleaved_with_generate(model):
    session = ortspec.Session(model, num_speculative_tokens=2)
    alone = [session.generate(p, max_new_tokens=12) for p in P[:3]]
    pair = session.generate(P[3:5], max_new_tokens=4)
    with session.batcher(max_batch_size=1) as one, session.batcher(max_batch_size=2) as two:
        a, b = one.add_request(P[0], max_new_tokens=12), two.add_request(P[1], max_new_tokens=12)
        c = two.add_request(P[2], max_new_tokens=12)
        while one.pending or two.pending:
            for batcher in (one, two):
                if batcher.pending:
                    batcher.step()
            assert session.generate(P[3], max_new_tokens=4) == pair[0]  # the batch size of `one`
            assert session.generate(P[3:5], max_new_tokens=4) == pair  # the batch size of `two`
        assert [one.result(a), two.result(b), two.result(c)] == alone


def test_two_batchers_of_one_size_stepped_alternately(model):
    session = ortspec.Session(model, num_speculative_tokens=3)
    alone = [session.generate(p, max_new_tokens=n) for p, n in zip(P[:4], (14, 9, 11, 16))]
    with session.batcher(max_batch_size=2) as first, session.batcher(max_batch_size=2) as second:
        ids = [first.add_request(P[0], 14), second.add_request(P[1], 9)]
        ids += [first.add_request(P[2], 11), second.add_request(P[3], 16)]
        while first.pending or second.pending:
            for batcher in (first, second):
                if batcher.pending:
                    batcher.step()
        outputs = [first.result(ids[0]), second.result(ids[1]), first.result(ids[2]), second.result(ids[3])]
    assert outputs == alone


def test_graph_slots_are_keyed_by_engine(model, monkeypatch):
    """Two batchers of one size run the same graphs at the same shapes, each under its own
    engine's key, so on CUDA each replays a graph bound to its own buffers."""
    seen = []
    original = GraphRunner.run

    def recording(self, feeds, slot=None, wait=True):
        if slot is not None:
            seen.append(slot.key if isinstance(slot, HostBinding) else slot)  # the CPU's: the key it stands for
        return original(self, feeds, slot, wait)

    monkeypatch.setattr(GraphRunner, "run", recording)
    session = ortspec.Session(model, num_speculative_tokens=2)
    with session.batcher(max_batch_size=1) as first, session.batcher(max_batch_size=1) as second:
        first.add_request(P[0], 6)
        second.add_request(P[1], 6)
        while first.pending or second.pending:
            first.step()
            second.step()
        engines = {first.decoder.engine.id, second.decoder.engine.id}
    by_shape = {}
    for key in seen:
        by_shape.setdefault((key.slot, key.tokens_per_row, key.batch_bucket), set()).add(key.engine)
    assert len(engines) == 2 and by_shape and all(found == engines for found in by_shape.values())


def test_waiting_on_engines_of_its_own_thread_is_refused(model):
    session = ortspec.Session(model, num_speculative_tokens=2, max_engines_per_batch_size=1)
    alone, pair = session.generate(P[0], max_new_tokens=8), session.generate(P[1:3], max_new_tokens=5)
    with session.batcher(max_batch_size=2) as batcher:
        rid = batcher.add_request(P[0], max_new_tokens=8)
        with pytest.raises(ortspec.EnginesHeldError, match="batch size 2 are held by this thread"):
            session.generate(P[1:3], max_new_tokens=5)
        assert session.generate(P[1], max_new_tokens=5) == pair[0]  # another size: its own engine
        while batcher.pending:
            batcher.step()
        assert batcher.result(rid) == alone
    assert session.generate(P[1:3], max_new_tokens=5) == pair  # closed: its engine is free again


def test_a_caller_beyond_the_cap_waits_for_an_engine(model):
    session = ortspec.Session(model, num_speculative_tokens=1, max_engines_per_batch_size=1)
    expected = session.generate(P[2], max_new_tokens=6)
    batcher = session.batcher(max_batch_size=1)
    result = {}
    waiter = threading.Thread(target=lambda: result.setdefault("out", session.generate(P[2], max_new_tokens=6)))
    waiter.start()
    deadline = time.monotonic() + 30
    while session.stats["engines"][1]["waiting"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert session.stats["engines"][1] == {"engines": 1, "leased": 1, "waiting": 1} and waiter.is_alive()
    batcher.close()
    waiter.join(timeout=30)
    assert result["out"] == expected


def test_engines_come_back_after_an_exception_and_from_an_unclosed_batcher(model):
    session = ortspec.Session(model, num_speculative_tokens=2, max_engines_per_batch_size=1)
    expected = session.generate(P[0], max_new_tokens=5)

    def failing(decoder, batch):
        raise RuntimeError("planted failure in a step")

    with pytest.raises(RuntimeError, match="planted failure"):
        session.generate(P[0], max_new_tokens=5, on_commit=failing)
    batcher = session.batcher(max_batch_size=1)
    batcher.add_request(P[1], max_new_tokens=5)
    del batcher  # never closed: garbage collection gives its engine back
    gc.collect()
    assert session.stats["engines"][1] == {"engines": 1, "leased": 0, "waiting": 0}
    assert session.generate(P[0], max_new_tokens=5) == expected


def test_a_closed_batcher_refuses_work_and_keeps_its_results(model):
    session = ortspec.Session(model, num_speculative_tokens=1)
    with session.batcher(max_batch_size=1) as batcher:
        rid = batcher.add_request(P[0], max_new_tokens=4)
        while batcher.pending:
            batcher.step()
    assert batcher.closed and len(batcher.result(rid)) == 4
    with pytest.raises(ortspec.ClosedError, match="this batcher is closed"):
        batcher.step()
    with pytest.raises(ortspec.ClosedError, match="this batcher is closed"):
        batcher.add_request(P[1], max_new_tokens=4)
    batcher.close()  # idempotent


def test_closing_a_session_releases_everything(model):
    with ortspec.Session(model, num_speculative_tokens=2) as session:
        expected = session.generate(P[0], max_new_tokens=6)
        batcher = session.batcher(max_batch_size=1)
        rid = batcher.add_request(P[0], max_new_tokens=6)
        batcher.step()
        graph = weakref.ref(session.graphs["decode"].session)
        kind = batcher.decoder.target.states.kinds[0]
        state = weakref.ref(kind.buffer if hasattr(kind, "buffer") else kind.key)
        del kind
    assert session.closed
    with pytest.raises(ortspec.ClosedError, match="Session .* is closed"):
        session.generate(P[0], max_new_tokens=6)
    with pytest.raises(ortspec.ClosedError):
        session.batcher(max_batch_size=1)
    with pytest.raises(ortspec.ClosedError, match="this Session is closed"):
        batcher.step()  # the open batcher was closed with its Session
    assert batcher.result(rid) == expected[: len(batcher.result(rid))]
    gc.collect()
    assert graph() is None and state() is None  # gone although the closed batcher is still held
    session.close()  # idempotent
    assert session.stats["generated_tokens"] > 0


def test_close_waits_for_a_call_in_flight(model):
    session = ortspec.Session(model, num_speculative_tokens=2)
    expected = session.generate(P[2], max_new_tokens=12)
    in_flight, result = threading.Event(), {}

    def slow(decoder, batch):
        in_flight.set()
        time.sleep(0.005)

    caller = threading.Thread(target=lambda: result.setdefault(
        "out", session.generate(P[2], max_new_tokens=12, on_commit=slow)))
    caller.start()
    assert in_flight.wait(timeout=30)
    session.close()
    caller.join(timeout=30)
    assert result["out"] == expected and session.closed


def test_close_from_inside_its_own_call_is_refused(model):
    session = ortspec.Session(model, num_speculative_tokens=1)
    expected = session.generate(P[1], max_new_tokens=4)

    def close_inside(decoder, batch):
        session.close()

    with pytest.raises(ortspec.EnginesHeldError, match="from inside one of its own calls"):
        session.generate(P[1], max_new_tokens=4, on_commit=close_inside)
    assert not session.closed and session.generate(P[1], max_new_tokens=4) == expected


def test_stats_merge_counts_every_field():
    counters = [f.name for f in dataclasses.fields(Stats) if f.type == "int"]
    one = Stats(**{name: n + 1 for n, name in enumerate(counters)}, accept_histogram=[1, 2])
    one.seconds["verify"] = 0.5
    total = Stats()
    total.merge(one)
    total.merge(one)
    doubled = {name: 2 * value for name, value in vars(one).items() if isinstance(value, int)}
    assert {name: getattr(total, name) for name in doubled} == doubled
    assert total.accept_histogram == [2, 4] and total.seconds["verify"] == 1.0


@pytest.mark.parametrize("cap", [0, 1.5, None])
def test_engine_cap_must_be_a_positive_integer(model, cap):
    with pytest.raises(ortspec.ConfigurationError, match="max_engines_per_batch_size"):
        ortspec.Session(model, max_engines_per_batch_size=cap)


def test_the_device_lock_is_granted_in_arrival_order():
    """On CUDA callers' steps take turns: a thread that releases the lock and asks again at once
    queues behind the threads already waiting (threading.RLock would usually hand it straight back)."""
    lock, order = FairLock(), []

    def take(name):
        with lock:
            order.append(name)

    lock.acquire()
    waiting = []
    for name in range(3):
        waiting.append(threading.Thread(target=take, args=(name,)))
        waiting[-1].start()
        deadline = time.monotonic() + 30
        while lock._next_ticket < name + 2 and time.monotonic() < deadline:  # its ticket is drawn
            time.sleep(0.001)
    with lock:  # re-entrant for its owner
        pass
    lock.release()
    take("again")  # asks right after releasing: served after the three waiting threads
    for thread in waiting:
        thread.join(timeout=30)
    assert order == [0, 1, 2, "again"]
    with pytest.raises(RuntimeError, match="does not hold it"):
        lock.release()


def test_every_cuda_graph_set_shares_one_lock():
    """ONNX Runtime captures CUDA graphs in the global capture mode: no other CUDA work of the
    process may run meanwhile, so two CUDA Sessions must serialize on one lock (on the H200 a
    per-Session lock let one Session's prefill fail while another captured). CPU GraphSets keep
    locks of their own."""
    from ortspec.runtime.graphs import CUDA_LOCK, lock_for

    assert lock_for("cuda") is lock_for("cuda") is CUDA_LOCK
    assert lock_for("cpu") is not lock_for("cpu")
