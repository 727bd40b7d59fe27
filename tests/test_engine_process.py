"""The engine in a process of its own (serve/engine_process.py, what ``ortspec serve`` runs): answers
equal Session.generate, streamed and not; the model's errors reach the parent typed; a full
queue is 429 here; a client that goes away frees its row there; /metrics counts what the child
did; a child that dies fails only its requests, and a new one serves the next.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

import ortspec
from ortspec.serve.server import Server
from tools.serve_load import complete, get

PROMPT = "the cache"


@pytest.fixture(scope="module")
def spawned(tokenized_model):
    with Server.spawned(tokenized_model, dict(num_speculative_tokens=2), port=0, max_batch_size=2,
                        max_queue=4) as server:
        yield server


def generated(session, prompt: str, n: int, **options) -> list[int]:
    return session.generate(session.tokenizer.encode(prompt).ids, max_new_tokens=n, **options)


def test_answers_equal_generate_streamed_or_not(spawned, session):
    want = generated(session, PROMPT, 12)
    whole = complete(spawned.url, {"prompt": PROMPT, "max_tokens": 12})
    streamed = complete(spawned.url, {"prompt": PROMPT, "max_tokens": 12, "stream": True})
    assert whole.status == streamed.status == 200
    assert whole.token_ids == streamed.token_ids == want
    assert whole.text == streamed.text == session.tokenizer.decode(want)
    sampled = [complete(spawned.url, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.9, "seed": 5})
               for _ in range(2)]
    assert sampled[0].token_ids == sampled[1].token_ids == session.generate(
        session.tokenizer.encode(PROMPT).ids, max_new_tokens=8, temperature=0.9, seed=5)


def test_many_clients_at_once_each_get_generates_tokens(spawned, session):
    prompts = [f"{PROMPT} {i}" for i in range(6)]
    results = [None] * len(prompts)

    def ask(i):
        results[i] = complete(spawned.url, {"prompt": prompts[i], "max_tokens": 10, "stream": i % 2 == 0})

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = [r.status for r in results]
    assert set(statuses) <= {200, 429}  # 2 rows and 4 queue slots for 6 requests: some may wait, none is lost
    for prompt, result in zip(prompts, results):
        if result.status == 200:
            assert result.token_ids == generated(session, prompt, 10)


def loop_reads(server) -> bool:
    """The server's event loop reads the engine's pipe (no reader thread hands its messages over)."""
    deadline = time.monotonic() + 10
    while server.engine._reader.is_alive() or server.engine._fd is None:  # noqa: SLF001  (within HANDOVER_S)
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_the_servers_loop_reads_the_pipe_while_it_serves(tokenized_model, session):
    server = Server.spawned(tokenized_model, dict(num_speculative_tokens=2), port=0, max_batch_size=2)
    assert server.engine._reader.is_alive()  # noqa: SLF001  (before the loop runs)
    with server:
        assert loop_reads(server)
        assert complete(server.url, {"prompt": PROMPT, "max_tokens": 7}).token_ids == generated(session, PROMPT, 7)
    assert server.engine._fd is None and not server.engine._process.is_alive()  # noqa: SLF001


def test_a_bad_model_is_a_typed_error_in_the_parent(tmp_path, tokenized_model):
    with pytest.raises(ortspec.ModelDirError):
        Server.spawned(tmp_path / "missing", {}, port=0)
    with pytest.raises(ortspec.ConfigurationError, match="threads"):  # raised by the child's Session
        Server.spawned(tokenized_model, dict(threads=10_000), port=0)
    with pytest.raises(ortspec.ConfigurationError, match="max_batch_size"):  # checked before a child is spawned
        Server.spawned(tokenized_model, {}, port=0, max_batch_size=0)


def test_metrics_count_what_the_child_did(spawned):
    before = metric(spawned, "generated_tokens_total")
    assert complete(spawned.url, {"prompt": PROMPT, "max_tokens": 5, "ignore_eos": True}).status == 200
    assert metric(spawned, "generated_tokens_total") == before + 5
    assert metric(spawned, "running_requests") == 0 and metric(spawned, "queue_depth") == 0
    deadline = time.monotonic() + 5
    while metric(spawned, "steps_total") == 0:  # the child's Session stats arrive every STATS_S
        assert time.monotonic() < deadline
        time.sleep(0.05)


def metric(server, name: str) -> float:
    status, text = get(server.url, "/metrics")
    assert status == 200
    [value] = [line.split()[-1] for line in text.splitlines() if line.startswith(f"ortspec_{name} ")]
    return float(value)


def test_a_client_that_goes_away_frees_its_row(spawned, session):
    import http.client

    cancelled = metric(spawned, 'requests_finished_total{reason="cancelled"}') if has_reason(spawned) else 0
    for _ in range(3):  # more than the 2 rows: each stream's row must come back
        connection = http.client.HTTPConnection("127.0.0.1", spawned.port, timeout=30)
        connection.request("POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 40,
                                                                  "ignore_eos": True, "stream": True}),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200
        response.readline()  # the first event: the request is running
        connection.close()
    assert complete(spawned.url, {"prompt": PROMPT, "max_tokens": 6}).token_ids == generated(session, PROMPT, 6)
    deadline = time.monotonic() + 10
    while not has_reason(spawned) or metric(spawned, 'requests_finished_total{reason="cancelled"}') < cancelled + 1:
        assert time.monotonic() < deadline, "no cancelled request was counted"
        time.sleep(0.05)


def has_reason(server) -> bool:
    return 'reason="cancelled"' in get(server.url, "/metrics")[1]


def test_a_dead_child_fails_its_requests_and_a_new_one_serves(tokenized_model, session):
    with Server.spawned(tokenized_model, dict(num_speculative_tokens=2), port=0, max_batch_size=2,
                        max_queue=16) as server:
        results, stop = [], threading.Event()

        def client():
            while not stop.is_set():
                results.append(complete(server.url, {"prompt": PROMPT, "max_tokens": 30, "ignore_eos": True,
                                                     "stream": True}, timeout=60))

        clients = [threading.Thread(target=client) for _ in range(3)]
        for c in clients:
            c.start()
        while not results:
            time.sleep(0.01)
        first = server.engine._process.pid  # noqa: SLF001
        os.kill(first, signal.SIGKILL)  # what a crash in native code, or the OOM killer, does
        seen, deadline = set(), time.monotonic() + 60
        while server.engine._process.pid == first or get(server.url, "/health")[0] != 200:  # noqa: SLF001
            seen.add(get(server.url, "/health")[0])
            assert time.monotonic() < deadline, "no new engine process"
            time.sleep(0.02)
        assert 503 in seen  # while the new child loads the model
        stop.set()
        for c in clients:
            c.join()
        answered = [r for r in results if r.status == 200 and not r.error]
        failed = [r for r in results if r not in answered]
        assert failed and all(r.status in (200, 500, 503) for r in failed)  # mid-stream: an error event; then 503
        want = generated(session, PROMPT, 30, stop_tokens=[])
        assert all(r.token_ids == want[: len(r.token_ids)] for r in results)
        assert answered and all(len(r.token_ids) == 30 for r in answered)
        after = complete(server.url, {"prompt": PROMPT, "max_tokens": 6})
        assert after.status == 200 and after.token_ids == generated(session, PROMPT, 6)
        assert loop_reads(server)  # the thread that replaced the child handed the pipe back


def test_the_parent_keeps_the_queue_and_the_counts_from_the_childs_events():
    """EngineProcess's own bookkeeping, without a child: a queue over max_queue is QueueFull before
    anything crosses; a job's first event moves it from the queue to running (admitted, prompt
    tokens), its last one ends it (finished, by reason); a cancelled job's end is not delivered; a
refused submit is counted under its status."""
    from ortspec.serve.engine import Finished, Job, QueueFull, Tokens
    from ortspec.serve.engine_process import EngineProcess
    from ortspec.speculative.sampling import GREEDY

    engine, sent, delivered = EngineProcess("unused", {}, max_batch_size=1, max_queue=2), [], []
    engine._conn = type("Pipe", (), {"send": lambda self, message: sent.append(message)})()  # noqa: SLF001

    def job(i):
        return Job([1, 2, 3], 4, GREEDY, time.monotonic() + 60, deliver=lambda event: delivered.append((i, event)))

    first, second = job(0), job(1)
    engine.submit(first, second)
    with pytest.raises(QueueFull, match="all 2 queue slots are taken"):
        engine.submit(job(2))
    assert [m[0] for m in sent] == ["submit"] and engine.queue_depth == 2 and engine.running == 0
    engine._take({"events": [(0, Tokens([7, 8]))]})  # noqa: SLF001
    assert engine.queue_depth == 1 and engine.running == 1 and engine.metrics.admitted == 1
    assert engine.metrics.prompt_tokens == 3 and engine.metrics.generated == 2
    third = job(3)
    engine.submit(third)  # the slot the first job left
    engine._take({"events": [(0, Finished("length")), (1, Finished("cancelled"))]})  # noqa: SLF001
    assert engine.metrics.finished == {429: 1, "length": 1, "cancelled": 1} and engine.running == 0  # 429: job 2
    assert [(i, type(e).__name__) for i, e in delivered] == [(0, "Tokens"), (0, "Finished")]
    engine.cancel(first)  # ended: nothing crosses
    assert len(sent) == 2

    def gone(message):
        raise BrokenPipeError(32, "Broken pipe")

    engine._conn.send = gone  # noqa: SLF001  (the child died; the reader has not seen it yet)
    with pytest.raises(QueueFull, match="the engine process exited") as refused:
        engine.submit(job(4))
    assert refused.value.status == 503 and engine.queue_depth == 1  # job 3 waits; nothing of job 4 is kept
    assert engine.metrics.finished[503] == 1  # refused: counted under its status
    engine.cancel(third)  # a cancel into a dead pipe is dropped: the restart fails its jobs
