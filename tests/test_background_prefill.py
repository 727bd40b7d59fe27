"""Prefills on the prefill thread (``add_requests(wait=False)``, the server's path on CUDA), here
forced on the CPU, where the thread's Run really runs beside the steps: every request's tokens
and its states after every commit equal those it gets decoded alone; a request cancelled while
its prefill runs ends with no tokens and frees its row; a prefill that fails ends its requests
alone ("error"), and the batch goes on."""

from __future__ import annotations

import functools
import threading

import pytest

import ortspec
from ortspec.runtime.graphs import GraphSet
from ortspec.runtime.model import TargetModel
from ortspec.serve.engine import Engine, Failed, Finished, Job, Tokens
from ortspec.speculative.sampling import GREEDY

from test_batching import REQUESTS, run_staggered, solo_references


@pytest.fixture(scope="module")
def solo(models):
    out = models.converted("mixed")
    return out, [ortspec.Session(out).generate(prompt, max_new_tokens=n) for prompt, n in REQUESTS]


@pytest.mark.parametrize("k,fixed_rows,pipelined", [(0, True, True), (2, True, True), (3, False, False)])
def test_prefills_apart_equal_solo_decoding_states_included(solo, monkeypatch, k, fixed_rows, pipelined):
    out, expected = solo
    session = ortspec.Session(out, num_speculative_tokens=k)
    threads, submitted = set(), []
    prefill_apart = TargetModel.prefill_apart

    def watched(model, *args):
        run = prefill_apart(model, *args)
        submitted.append(threading.get_ident())
        return lambda: (threads.add(threading.get_ident()), run())[1]

    monkeypatch.setattr(TargetModel, "prefill_apart", watched)
    outputs, checked = run_staggered(session, refs=solo_references(GraphSet(session.manifest), k), p=None,
                                     fixed_rows=fixed_rows, pipelined=pipelined, background_prefill=True, wait=False)
    assert outputs == expected and len(checked) >= len(REQUESTS)
    assert len(submitted) == len(REQUESTS) - 1  # every arrival but the first (no row ran then) went apart
    assert threads and threading.get_ident() not in threads  # the Runs ran on the prefill thread


def test_a_request_cancelled_while_its_prefill_runs_frees_its_row(solo):
    out, expected = solo
    session = ortspec.Session(out, num_speculative_tokens=2)
    with session.batcher(max_batch_size=3, background_prefill=True, pipelined=True, fixed_rows=True) as batcher:
        first = batcher.add_requests([dict(prompt=REQUESTS[0][0], max_new_tokens=REQUESTS[0][1])], wait=False)[0]
        assert batcher.decoder.joining_rows == set()  # no row ran: prefilled at once, on this thread
        middle = batcher.add_requests([dict(prompt=REQUESTS[1][0], max_new_tokens=REQUESTS[1][1])], wait=False)[0]
        gone = batcher.add_requests([dict(prompt=[9, 9, 9], max_new_tokens=20)], wait=False)[0]
        assert batcher.decoder.joining_rows == {1, 2}
        batcher.cancel(gone)
        assert batcher.result(gone) == [] and batcher.finish_reason(gone) == "cancelled"
        assert batcher.decoder.joining_rows == {1}  # the cancelled request's row is free at once
        reported = {first: batcher.step()[first], middle: []}
        later = batcher.add_requests([dict(prompt=REQUESTS[2][0], max_new_tokens=REQUESTS[2][1])], wait=False)[0]
        reported[later] = []
        while batcher.pending:
            for rid, tokens in batcher.step().items():
                assert rid != gone
                reported[rid] += tokens
        assert batcher.result(gone) == []
        for rid, i in ((first, 0), (middle, 1), (later, 2)):
            assert reported[rid] == batcher.result(rid) == expected[i]


def test_a_failed_prefill_ends_its_requests_alone(solo, monkeypatch):
    out, expected = solo
    session = ortspec.Session(out, num_speculative_tokens=2)
    prefill_apart = TargetModel.prefill_apart

    def failing(model, rows, ids, positions):
        run = prefill_apart(model, rows, ids, positions)
        if ids.shape[1] == 3:
            return lambda: (_ for _ in ()).throw(MemoryError("no device memory for this prompt"))
        return run

    monkeypatch.setattr(TargetModel, "prefill_apart", failing)
    with session.batcher(max_batch_size=3, background_prefill=True, pipelined=True) as batcher:
        good = batcher.add_requests([dict(prompt=REQUESTS[0][0], max_new_tokens=REQUESTS[0][1])], wait=False)[0]
        bad = batcher.add_requests([dict(prompt=[4, 5, 6], max_new_tokens=9)] * 2, wait=False)  # n = 2 choices
        while batcher.pending:
            batcher.step()
        for rid in bad:
            assert batcher.finish_reason(rid) == "error" and batcher.result(rid) == []
            assert isinstance(batcher.error(rid), MemoryError)
        assert batcher.result(good) == expected[0] and batcher.error(good) is None
        again = batcher.add_requests([dict(prompt=REQUESTS[1][0], max_new_tokens=REQUESTS[1][1])] * 3, wait=False)
        while batcher.pending:
            batcher.step()
        assert [batcher.result(rid) for rid in again] == [expected[1]] * 3  # every row was free again


def test_close_waits_for_a_prefill_on_its_thread(solo, monkeypatch):
    """Session.close() while a prefill runs apart: it waits for the Run, then releases the buffers."""
    out, _ = solo
    session = ortspec.Session(out, num_speculative_tokens=2)
    started, release, finished = threading.Event(), threading.Event(), []
    prefill_apart = TargetModel.prefill_apart

    def slow(model, *args):
        run = prefill_apart(model, *args)
        return lambda: (started.set(), release.wait(10), finished.append(run()))[-1]

    monkeypatch.setattr(TargetModel, "prefill_apart", slow)
    batcher = session.batcher(max_batch_size=2, background_prefill=True, pipelined=True)
    batcher.add_requests([dict(prompt=[7, 8], max_new_tokens=8)], wait=False)  # no row ran: prefilled here
    assert not started.is_set()
    batcher.add_requests([dict(prompt=[1, 2, 3], max_new_tokens=4)], wait=False)  # beside a running row: apart
    assert started.wait(10)
    closing = threading.Thread(target=session.close)
    closing.start()
    closing.join(0.3)
    assert closing.is_alive() and not finished  # waiting for the Run
    release.set()
    closing.join(10)
    assert not closing.is_alive() and finished and session.closed


def test_the_engine_fails_only_the_job_whose_prefill_failed(solo, monkeypatch):
    """The server's engine thread on a decoder whose prefills run apart: the job whose prefill
    failed gets 500, the others their tokens, and the engine goes on."""
    out, expected = solo
    session = ortspec.Session(out, num_speculative_tokens=2)
    monkeypatch.setattr(session, "batcher", functools.partial(session.batcher, background_prefill=True, pipelined=True))
    prefill_apart = TargetModel.prefill_apart

    def failing(model, rows, ids, positions):
        run = prefill_apart(model, rows, ids, positions)
        return (lambda: (_ for _ in ()).throw(RuntimeError("planted"))) if ids.shape[1] == 3 else run

    monkeypatch.setattr(TargetModel, "prefill_apart", failing)
    engine = Engine(session, max_batch_size=2, max_queue=8)
    engine.start()
    events: dict[str, list] = {}
    done = threading.Semaphore(0)

    def job(name, prompt, n):
        def deliver(event):
            events[name].append(event)
            if isinstance(event, (Finished, Failed)):
                done.release()
        events[name] = []
        return Job(prompt=list(prompt), max_tokens=n, sampling=GREEDY, deadline=float("inf"), deliver=deliver,
                   id=name)

    try:
        engine.submit(job("a", *REQUESTS[0]))
        engine.submit(job("bad", [7, 7, 7], 5))
        engine.submit(job("b", *REQUESTS[1]))
        for _ in range(3):
            assert done.acquire(timeout=60)
    finally:
        engine.stop()
    tokens = {name: [t for e in evs if isinstance(e, Tokens) for t in e.ids] for name, evs in events.items()}
    assert isinstance(events["bad"][-1], Failed) and events["bad"][-1].status == 500 and tokens["bad"] == []
    assert tokens["a"] == expected[0] and tokens["b"] == expected[1]
    assert isinstance(events["a"][-1], Finished) and isinstance(events["b"][-1], Finished)


def test_choices_of_one_prompt_prefilled_apart_equal_one_row_each(solo):
    """An API request's n = 3 choices through the prefill thread: one prefill, the other rows its
    copies, each greedy choice the prompt's own tokens."""
    out, expected = solo
    session = ortspec.Session(out, num_speculative_tokens=2)
    prompt, n = REQUESTS[2]
    with session.batcher(max_batch_size=4, background_prefill=True, pipelined=True, fixed_rows=True) as batcher:
        first = batcher.add_requests([dict(prompt=REQUESTS[0][0], max_new_tokens=REQUESTS[0][1])], wait=False)[0]
        batcher.step()
        choices = batcher.add_requests([dict(prompt=prompt, max_new_tokens=n)] * 3, wait=False)
        while batcher.pending:
            batcher.step()
        assert [batcher.result(rid) for rid in choices] == [expected[2]] * 3
        assert batcher.result(first) == expected[0]


def test_a_long_prompt_joins_apart_while_short_ones_run(models):
    """On the CPU the caches are laid out for each forward's window: the steps that run while a
    long prompt's prefill runs apart lay them out for their short windows, and its commit lays
    them out for its own again before writing (tokens equal solo decoding)."""
    out = models.converted("mixed")
    short, long = [([5, 6, 7], 40), ([9, 10], 40)], (list(range(3, 203)), 12)
    expected = [ortspec.Session(out).generate(p, max_new_tokens=n) for p, n in short + [long]]
    session = ortspec.Session(out, num_speculative_tokens=2)
    with session.batcher(max_batch_size=3, background_prefill=True) as batcher:
        ids = batcher.add_requests([dict(prompt=p, max_new_tokens=n) for p, n in short], wait=False)
        for _ in range(3):
            batcher.step()
        ids += batcher.add_requests([dict(prompt=long[0], max_new_tokens=long[1])], wait=False)
        while batcher.pending:
            batcher.step()
        assert [batcher.result(rid) for rid in ids] == expected


@pytest.mark.parametrize("seed", [0, 1])
def test_random_arrivals_and_cancels_apart(solo, seed):
    """Requests joining apart at random steps, some cancelled while they join or run, n > 1
    choices among them: every request not cancelled gets its solo tokens, a cancelled one a prefix
    of them, and every row is free at the end."""
    import numpy as np

    out, expected = solo
    session = ortspec.Session(out, num_speculative_tokens=2)
    rng = np.random.default_rng(seed)
    with session.batcher(max_batch_size=4, background_prefill=True, pipelined=True, fixed_rows=bool(seed)) as batcher:
        submitted, cancelled, joining_cancels = [], set(), 0
        queue = [int(i) for i in rng.integers(0, len(REQUESTS), 14)]
        while queue or batcher.pending:
            free = batcher.max_batch_size - len(batcher.running)
            if queue and free and rng.random() < 0.5:
                i = queue.pop()
                n = min(free, int(rng.integers(1, 3)))
                ids = batcher.add_requests([dict(prompt=REQUESTS[i][0], max_new_tokens=REQUESTS[i][1])] * n, wait=False)
                submitted += [(rid, i) for rid in ids]
                if rng.random() < 0.3:  # while it joins: its prefill is not seated before the next step
                    batcher.cancel(ids[-1])
                    cancelled.add(ids[-1])
                    joining_cancels += 1
            running = batcher.running
            if running and rng.random() < 0.15:
                rid = running[int(rng.integers(len(running)))]
                batcher.cancel(rid)
                cancelled.add(rid)
            if batcher.pending:
                batcher.step()
        for rid, i in submitted:
            tokens = batcher.result(rid)
            if rid in cancelled:
                assert tokens == expected[i][: len(tokens)]
            else:
                assert tokens == expected[i], (rid, i)
        assert not batcher.decoder.joining_rows and not batcher.running
        assert joining_cancels and len(cancelled) > joining_cancels  # both kinds of cancel happened


def test_the_session_option_and_the_serve_flag(models, tokenized_model, monkeypatch):
    """Session(prefill_thread=...) sets its batchers' default (a batcher's own option wins), a
    bad value is a ConfigurationError, and `ortspec serve --prefill-thread on|off|auto` passes it
    on (checked with its Session options, before any model loads)."""
    from ortspec import cli
    from ortspec.errors import ConfigurationError
    from ortspec.serve import server as server_module

    out = models.converted("mixed")
    with pytest.raises(ConfigurationError, match=r"prefill_thread='yes' must be True, False or None"):
        ortspec.Session(out, prefill_thread="yes")
    session = ortspec.Session(out, num_speculative_tokens=2, prefill_thread=True)
    with session.batcher(max_batch_size=2) as batcher:
        assert batcher.decoder._prefills is not None
    with session.batcher(max_batch_size=2, background_prefill=False) as batcher:
        assert batcher.decoder._prefills is None
    with ortspec.Session(out).batcher(max_batch_size=2) as batcher:
        assert batcher.decoder._prefills is None  # the CPU's default
    seen = []
    monkeypatch.setattr(server_module.Server, "spawned", classmethod(
        lambda cls, model, session_options, **options: (seen.append(session_options["prefill_thread"]),
                                                         (_ for _ in ()).throw(SystemExit(0)))[1]))
    for flag, value in (("on", True), ("off", False), ("auto", None)):
        with pytest.raises(SystemExit):
            cli.main(["serve", str(tokenized_model), "--prefill-thread", flag])
    assert seen == [True, False, None]
    with pytest.raises(SystemExit) as refused:
        cli.main(["serve", str(tokenized_model), "--prefill-thread", "sometimes"])
    assert refused.value.code == 2


def test_a_server_with_its_prefills_apart_on_the_cpu(tokenized_model, monkeypatch):
    """The thread engine over Session(prefill_thread=True): every streamed answer equals
    generate's, and the prefills ran on the prefill thread."""
    from tools.serve_load import run_clients, workload

    from ortspec.serve.server import Server

    threads = set()
    prefill_apart = TargetModel.prefill_apart

    def watched(model, *args):
        run = prefill_apart(model, *args)
        return lambda: (threads.add(threading.current_thread().name), run())[1]

    monkeypatch.setattr(TargetModel, "prefill_apart", watched)
    bodies = workload(6, 3, (4, 24), "both")
    with ortspec.Session(tokenized_model, num_speculative_tokens=2, threads=1, prefill_thread=True) as session:
        want = {(b["prompt"], b["max_tokens"]): session.generate(b["prompt"], max_new_tokens=b["max_tokens"])
                for client in bodies for b in client}
        server = Server(session, port=0, max_batch_size=4, max_queue=32).start()
        try:
            results, _ = run_clients(server.url, bodies)
        finally:
            server.stop()
    for client, replies in zip(bodies, results):
        for body, reply in zip(client, replies):
            assert reply.status == 200 and reply.text == want[(body["prompt"], body["max_tokens"])], body
    assert threads and all(name.startswith("ortspec-prefill") for name in threads)
