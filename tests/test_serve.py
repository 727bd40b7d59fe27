"""ortspec serve over loopback: answers equal Session.generate, streamed equals non-streamed, bad
requests get 400 with a message, a full queue 429, timeouts, a client that goes away frees its
row, chat templates, /health and /metrics, and a clean shutdown.

The engine is paused where a test needs a deterministic interleaving: a gate at the start of
its turn (``Engine._end``) holds it while requests queue up, time out or disconnect.
"""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import threading
import time

import pytest

import ortspec
from ortspec.serve.engine import Engine
from ortspec.serve.server import Server
from tools.make_tiny_checkpoint import make_checkpoint
from tools.serve_load import complete, get

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def server(session):
    with Server(session, port=0, max_batch_size=4) as s:
        yield s


class Gate:
    """Holds the engine at the start of each turn until let through (the turn reads its clock after)."""

    def __init__(self, engine: Engine, monkeypatch) -> None:
        self.turns, self.opened = threading.Semaphore(0), threading.Event()
        original = engine._end

        def gated(now):
            if not self.opened.is_set():
                self.turns.acquire()
            return original(time.monotonic())

        monkeypatch.setattr(engine, "_end", gated)

    def one_turn(self) -> None:
        self.turns.release()

    def open(self) -> None:
        self.opened.set()
        self.turns.release()

    def __enter__(self) -> "Gate":
        return self

    def __exit__(self, *exc) -> None:
        self.open()  # a failed test must not leave the engine held: the server's stop() joins it


def metric(url: str, name: str) -> float:
    text = get(url, "/metrics")[1]
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"ortspec_{name}"))


def wait_for(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def test_completions_equal_session_generate(server, session):
    for prompt, n in [("def main(", 12), ("the cache", 30), ("é", 5)]:
        want = session.generate(prompt, max_new_tokens=n)
        whole = complete(server.url, {"prompt": prompt, "max_tokens": n})
        streamed = complete(server.url, {"prompt": prompt, "max_tokens": n, "stream": True})
        assert whole.text == streamed.text == want and whole.token_ids == streamed.token_ids
        reason = "length" if len(whole.token_ids) == n else "stop"  # or it made the eos token
        assert whole.finish_reason == streamed.finish_reason == reason and streamed.chunks >= 2
    ids = session.tokenizer.encode("def main(").ids
    assert complete(server.url, {"prompt": ids, "max_tokens": 6}).token_ids == session.generate(ids, max_new_tokens=6)


def test_sampled_completions_follow_the_seed(server, session):
    body = {"prompt": "def main(", "max_tokens": 20, "temperature": 1.3, "top_p": 0.9, "top_k": 30, "seed": 11}
    want = session.generate("def main(", max_new_tokens=20, temperature=1.3, top_p=0.9, top_k=30, seed=11)
    assert complete(server.url, body).text == complete(server.url, {**body, "stream": True}).text == want


def test_min_p_is_served(server, session):
    body = {"prompt": "def main(", "max_tokens": 20, "temperature": 1.1, "min_p": 0.2, "seed": 5}
    want = session.generate("def main(", max_new_tokens=20, temperature=1.1, min_p=0.2, seed=5)
    assert complete(server.url, body).text == complete(server.url, {**body, "stream": True}).text == want


def test_ignore_eos_runs_past_the_models_stop_tokens(tokenized_model, monkeypatch):
    with ortspec.Session(tokenized_model, num_speculative_tokens=2) as session:
        ids = session.tokenizer.encode("the cache").ids
        free = session.generate(ids, max_new_tokens=30, stop_tokens=[])
        spec = session.manifest.spec  # make the 6th greedy token the model's eos
        monkeypatch.setattr(session.manifest, "spec", dataclasses.replace(spec, eos_token_ids=(free[5],)))
        with Server(session, port=0, max_batch_size=2) as server:
            stopped = complete(server.url, {"prompt": ids, "max_tokens": 30})
            ignored = complete(server.url, {"prompt": ids, "max_tokens": 30, "ignore_eos": True, "stream": True})
    first = free.index(free[5])
    assert stopped.token_ids == free[: first + 1] and stopped.finish_reason == "stop"
    assert ignored.token_ids == free and ignored.finish_reason == "length"


@pytest.mark.parametrize("body,status,match", [
    (b"{not json", 400, r"not valid JSON"),
    (b"[1, 2]", 400, r"JSON array; send a JSON object"),
    ({"max_tokens": 4}, 400, r'no "prompt"'),
    ({"prompt": ["a", "b"]}, 400, r"2 prompts; send one prompt per request"),
    ({"prompt": "a", "max_tokens": 0}, 400, r"max_tokens=0 must be an integer >= 1"),
    ({"prompt": "a", "temperature": "hot"}, 400, r'temperature="hot" must be a number; got a string'),
    ({"prompt": "a", "top_p": 2}, 400, r"top_p=2 must be a number in \(0, 1\]"),
    ({"prompt": "a", "min_p": 1.5}, 400, r"min_p=1.5 must be a number in \[0, 1\]"),
    ({"prompt": "a", "ignore_eos": "yes"}, 400, r"ignore_eos"),
    ({"prompt": "a", "stop": list("abcde")}, 400, r"must hold at most 4 strings"),
    ({"prompt": "a", "stop": ["\n", ""]}, 400, r"array of non-empty strings"),
    ({"prompt": "a", "n": 5}, 400, r"n=5 must be an integer in \[1, 4\]: each choice takes a row"),
    ({"prompt": "a", "logprobs": 6}, 400, r"logprobs=6 must be an integer in \[0, 5\]"),
    ({"prompt": "a", "echo": True, "logprobs": 1}, 400, r"echo with logprobs .* is not supported"),
    ({"prompt": "a", "logit_bias": {"5": 10}}, 400, r"logit_bias=.* is not supported by ortspec serve"),
    ({"prompt": "a", "best_of": 2}, 400, r"best_of=2 is not supported by ortspec serve; leave it out or send 1"),
    ({"prompt": "a", "timeout": 0}, 400, r"timeout=0 must be a number of seconds"),
    ({"prompt": [3, 99999]}, 400, r"token id 99999 outside the vocabulary"),
    ({"prompt": "a " * 60, "max_tokens": 8}, 400, r"> max_length=48"),
])
def test_bad_requests_get_400_with_a_message(server, body, status, match):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection = socket.create_connection(("127.0.0.1", server.port))
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(raw)}\r\nConnection: close\r\n\r\n").encode() + raw
    connection.sendall(request)
    reply = b"".join(iter(lambda: connection.recv(65536), b""))
    connection.close()
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.split()[1] == str(status).encode()
    assert re.search(match, json.loads(payload)["error"]["message"])
    assert complete(server.url, {"prompt": "a", "max_tokens": 2}).status == 200  # still serving


def test_routes(server):
    assert json.loads(get(server.url, "/health")[1]) == {"status": "ok", "model": server.model_name}
    assert json.loads(get(server.url, "/v1/models")[1])["data"][0]["id"] == server.model_name
    status, body = get(server.url, "/nowhere")
    assert status == 404
    no_chat = complete(server.url, {"messages": [{"role": "user", "content": "hi"}]}, route="/v1/chat/completions")
    assert no_chat.status == 404 and "no chat template" in no_chat.error
    assert complete(server.url, {"prompt": "a", "max_tokens": 2}).status == 200
    text = get(server.url, "/metrics")[1]
    for name in ("tokens_per_second", "acceptance_rate", "queue_depth", "running_requests", "generated_tokens_total"):
        assert f"\nortspec_{name} " in text
    busy = {line.split("{")[1].split("}")[0]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("ortspec_engine_seconds_total{")}
    assert busy.get('phase="prefill"', 0) > 0  # the completion above was prefilled


def test_a_full_queue_answers_429(session, monkeypatch):
    with Server(session, port=0, max_batch_size=1, max_queue=2) as server, Gate(server.engine, monkeypatch) as gate:
        results = []
        waiting = [threading.Thread(target=lambda: results.append(complete(server.url, {"prompt": "a", "max_tokens": 3})))
                   for _ in range(2)]
        for t in waiting:
            t.start()
        wait_for(lambda: metric(server.url, "queue_depth") == 2)
        refused = complete(server.url, {"prompt": "a", "max_tokens": 3})
        assert refused.status == 429 and "all 2 queue slots are taken" in refused.error
        gate.open()
        for t in waiting:
            t.join()
        assert [r.status for r in results] == [200, 200]


def test_timeouts_stop_a_request_or_fail_a_queued_one(session, monkeypatch):
    with Server(session, port=0, max_batch_size=1) as server, Gate(server.engine, monkeypatch) as gate:
        replies = {}
        body = {"prompt": "a", "max_tokens": 40, "timeout": 2.0, "stream": True}
        running = threading.Thread(target=lambda: replies.update(running=complete(server.url, body)))
        running.start()
        wait_for(lambda: metric(server.url, "queue_depth") == 1)
        gate.one_turn()  # admitted and stepped once, then held
        wait_for(lambda: metric(server.url, "running_requests") == 1)

        queued = threading.Thread(target=lambda: replies.update(queued=complete(server.url, {"prompt": "a",
                                                                                          "timeout": 0.1})))
        queued.start()
        wait_for(lambda: metric(server.url, "queue_depth") == 1)
        time.sleep(0.2)
        gate.one_turn()  # past its deadline, and the only row is taken
        queued.join()
        assert replies["queued"].status == 503 and "timed out waiting for a free row" in replies["queued"].error

        time.sleep(2.0)  # the running one past its deadline too
        gate.open()
        running.join()
        assert replies["running"].finish_reason == "timeout" and 1 <= len(replies["running"].token_ids) < 40


def test_a_client_that_goes_away_frees_its_row(session, monkeypatch):
    with Server(session, port=0, max_batch_size=1) as server, Gate(server.engine, monkeypatch) as gate:
        connection = socket.create_connection(("127.0.0.1", server.port))
        raw = json.dumps({"prompt": "a", "max_tokens": 40, "stream": True}).encode()
        connection.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(raw)}\r\n\r\n").encode()
                           + raw)
        wait_for(lambda: metric(server.url, "queue_depth") == 1)
        gate.one_turn()  # admitted, stepped once; then the engine holds with the request in the only row
        received = b""
        while b"data: " not in received:  # the headers, then the first event
            received += connection.recv(65536)
        assert metric(server.url, "running_requests") == 1
        connection.close()
        time.sleep(1.5)  # the handler notices and cancels the job
        gate.open()
        wait_for(lambda: metric(server.url, "running_requests") == 0)
        assert metric(server.url, 'requests_finished_total{reason="cancelled"}') == 1
        assert complete(server.url, {"prompt": "a", "max_tokens": 3}).status == 200


def test_chat_completions_render_the_model_template(tmp_path):
    make_checkpoint(tmp_path / "ck", seed=31, tokenizer=True)
    config = json.loads((tmp_path / "ck" / "tokenizer_config.json").read_text())
    (tmp_path / "ck" / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    out = ortspec.convert(tmp_path / "ck", tmp_path / "out", num_speculative_tokens=1, max_length=64, progress=False)
    messages = [{"role": "user", "content": "hi"}]
    with ortspec.Session(out, num_speculative_tokens=1) as session, Server(session, port=0) as server:
        want = session.generate("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", max_new_tokens=8)
        for stream in (False, True):
            reply = complete(server.url, {"messages": messages, "max_tokens": 8, "stream": stream},
                             route="/v1/chat/completions")
            assert reply.status == 200 and reply.text == want


def test_shutdown_is_clean(session):
    before = set(threading.enumerate())
    server = Server(session, port=0).start()
    assert complete(server.url, {"prompt": "a", "max_tokens": 4}).status == 200
    server.stop()
    assert set(threading.enumerate()) <= before  # the engine and HTTP threads are gone
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=1)
    assert len(session.generate("a", max_new_tokens=3)) > 0  # the Session stays usable


def test_the_serve_command_refuses_a_bad_model_dir_or_a_busy_port(tmp_path, tokenized_model, capsys):
    from ortspec import cli

    assert cli.main(["serve", str(tmp_path)]) == 2
    assert "has no manifest.json" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert cli.main(["serve", str(tokenized_model), "--port", str(busy.getsockname()[1])]) == 2
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err


def test_an_exact_mode_server_answers_as_exact_generate(tokenized_model):
    """`ortspec serve --exact`: the server's one batcher runs the Session's fixed shape, and each
    answer equals that exact Session's own generate (streamed or not)."""
    with ortspec.Session(tokenized_model, num_speculative_tokens=2, exact=True, exact_batch_size=2) as exact, \
            Server(exact, port=0, max_batch_size=2) as server:
        for prompt, n in [("def main(", 10), ("the cache", 14)]:
            want = exact.generate(prompt, max_new_tokens=n)
            assert complete(server.url, {"prompt": prompt, "max_tokens": n}).text == want
            assert complete(server.url, {"prompt": prompt, "max_tokens": n, "stream": True}).text == want


def test_the_choices_of_a_request_are_queued_all_or_none(session):
    from ortspec.serve.engine import Job, QueueFull
    from ortspec.speculative.sampling import GREEDY

    engine = Engine(session, max_batch_size=2, max_queue=3)  # not started: jobs stay queued
    jobs = [Job([1, 2], 4, GREEDY, time.monotonic() + 60, deliver=lambda event: None) for _ in range(4)]
    engine.submit(*jobs[:2])
    with pytest.raises(QueueFull, match=r"1 of 3 queue slots are free, for 2 choices"):
        engine.submit(*jobs[2:])
    assert engine.queue_depth == 2



def test_a_request_is_counted_running_once_when_its_first_token_goes_out(session):
    """The first token leaves with the admission (Batcher.report); by then the job counts once in
    ``running`` (it had counted twice, being admitted and running, until the admission returned)."""
    from ortspec.serve.engine import Finished, Job, Tokens
    from ortspec.speculative.sampling import GREEDY

    seen, done = [], threading.Event()
    engine = Engine(session, max_batch_size=1, max_queue=4)

    def deliver(event):
        if isinstance(event, Tokens) and not seen:
            seen.append(engine.running)  # on the engine thread, inside the admission
        elif isinstance(event, Finished):
            done.set()

    engine.start()
    try:
        engine.submit(Job([5, 6, 7], 3, GREEDY, time.monotonic() + 60, deliver=deliver))
        assert done.wait(30)
    finally:
        engine.stop()
    assert seen == [1]


def test_requests_refused_while_checked_are_counted(server):
    """/metrics counts what the HTTP side refuses before anything is queued, by status."""
    before = {status: metric(server.url, f'requests_refused_total{{status="{status}"}}') for status in (400, 422)}
    assert complete(server.url, {"prompt": [1, 2, 3], "max_tokens": -1}).status == 400
    assert complete(server.url, {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": "hot"}).status == 400
    after = {status: metric(server.url, f'requests_refused_total{{status="{status}"}}') for status in (400, 422)}
    assert after[400] == before[400] + 2 and after[422] == before[422]
    assert "# TYPE ortspec_requests_refused_total counter" in get(server.url, "/metrics")[1]
