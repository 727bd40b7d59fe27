"""ortspec serve against a hostile or careless client, second round: a client that stops reading
its answer, clients hanging up mid-stream (n > 1, logprobs, stop strings, during the prefill),
an engine process killed under requests, and values at the edges of what JSON lets a body say
(booleans for integers, -0, huge and tiny numbers, duplicate keys, surrogates in messages)."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import threading
import time

import pytest

from ortspec.serve import limits
from ortspec.serve.server import Server
from tools.serve_load import complete, get

from tests.test_hostile_server import Records, hold_admission, post, serving, slow_batcher_steps
from tests.test_redteam_server import chat_server  # noqa: F401  (a fixture)
from tests.test_serve import metric, server, wait_for  # noqa: F401  (server: a fixture)

PROMPT = "def f("
VALUES = [  # a body's field -> its status and what the message says (200: served)
    ({"max_tokens": True}, 400, r"max_tokens=true must be an integer; got a boolean"),
    ({"max_tokens": "16"}, 400, r"max_tokens=\"16\" must be an integer; got a string"),
    ({"max_tokens": 1.0}, 400, r"max_tokens=1.0 must be an integer, written without a fraction"),
    ({"max_tokens": -0}, 400, r"max_tokens=0 must be an integer >= 1"),
    ({"n": 0}, 400, r"n=0 must be an integer in \[1, 4\]"),
    ({"n": True}, 400, r"n=true must be an integer"),
    ({"stop": [""]}, 400, r"stop=\[\"\"\] must be a string or an array of non-empty strings"),
    ({"stop": "\u0000"}, 200, None),
    ({"logprobs": True}, 400, r"logprobs=true must be an integer in \[0, 5\]"),
    ({"top_p": 1e-45, "temperature": 1.0, "seed": 3}, 200, None),  # float32's least subnormal: one token kept
    ({"top_k": 2**63 - 1, "temperature": 1.0, "seed": 3}, 200, None),
    ({"prompt": [[]]}, 400, r"prompt=\[\[\]\] must be a non-empty string or a non-empty array of token ids"),
    ({"prompt": [[1, [2]]]}, 400, r"prompt=\[\[1, \[2\]\]\] must be a non-empty string"),
    ({"prompt": [True, 2]}, 400, r"prompt=\[true, 2\] must be a non-empty string"),
    ({"prompt": [1, 2**63]}, 400, r"token id 9223372036854775808 outside the vocabulary"),
]


@pytest.mark.parametrize("fields,status,match", VALUES, ids=[json.dumps(f)[:40] for f, _, _ in VALUES])
def test_a_value_at_the_edge_of_json_is_served_or_named(server, session, fields, status, match):
    got, reply = post(server.port, json.dumps({"prompt": PROMPT, "max_tokens": 4, **fields}).encode())
    assert got == status, reply
    if match:
        assert re.search(match, reply["error"]["message"]) and reply["error"]["type"] == "invalid_request_error"
    else:
        assert len(reply["choices"][0]["token_ids"]) >= 1


@pytest.mark.parametrize("raw,match", [
    (b'{"prompt": "def f(", "max_tokens": 1e309}', r"the number 1e309, beyond the largest this server parses"),
    (b'{"prompt": "def f(", "max_tokens": 4, "max_tokens": "x"}', r"max_tokens=\"x\" must be an integer"),
])
def test_a_body_only_python_parses_is_named(server, raw, match):
    status, reply = post(server.port, raw)
    assert status == 400 and re.search(match, reply["error"]["message"]), reply


def test_a_duplicate_key_means_its_last_value(server, session):
    """As every JSON parser a client may compare with (and Python's) reads it."""
    status, reply = post(server.port, b'{"prompt": "x", "prompt": "def f(", "max_tokens": 3}')
    assert status == 200 and reply["choices"][0]["text"] == session.generate(PROMPT, max_new_tokens=3)


@pytest.mark.parametrize("message,match", [
    ({"role": "user", "content": "ab\ud800"}, r"messages\[1\]\.content holds an unpaired surrogate U\+D800 at "
                                              r"character 2"),
    ({"role": "user", "content": [{"type": "text", "text": "\udfff"}]}, r"messages\[1\]\.content holds an unpaired"),
    ({"role": "\ud800", "content": "x"}, r"messages\[1\]\.role holds an unpaired surrogate"),
    ({"role": "user", "content": None}, r"messages\[1\]=.* must be an object with a string \"role\" and a \"content\""),
    ({"role": "user", "content": 5}, r"messages\[1\]=.* must be an object with a string \"role\""),
    ({"content": "x"}, r"messages\[1\]=.* must be an object with a string \"role\""),
    ({"role": "user", "content": ["x"]}, r"messages\[1\]\.content\[0\] has type null; ortspec serve takes text parts"),
])
def test_a_wrong_message_is_named_by_its_index(chat_server, message, match):  # noqa: F811
    body = {"messages": [{"role": "system", "content": "s"}, message], "max_tokens": 2}
    status, reply = post(chat_server.port, json.dumps(body).encode(), route="/v1/chat/completions")
    assert status == 400 and re.search(match, reply["error"]["message"]), reply


@pytest.mark.parametrize("messages", [
    [{"role": "tool", "content": "x", "tool_call_id": "1"}, {"role": "wizard", "content": "y"}],  # the template's call
    [{"role": "user", "content": []}],  # no text parts: empty text
    lambda limit: [{"role": "u", "content": ""}] * (limit // 5),  # many tiny messages under the bound
])
def test_roles_and_contents_the_template_takes_are_served(chat_server, messages):  # noqa: F811
    body = {"messages": messages(chat_server.limits.max_prompt_chars) if callable(messages) else messages,
            "max_tokens": 2}
    status, reply = post(chat_server.port, json.dumps(body).encode(), route="/v1/chat/completions")
    if status == 400:  # only for a rendered prompt longer than the model's max_length
        assert "max_length" in reply["error"]["message"], reply
    else:
        assert status == 200 and len(reply["choices"][0]["token_ids"]) == 2, reply


# -- clients that stop reading, or hang up ------------------------------------------------------
def stalled_stream(port: int, body: dict) -> socket.socket:
    """A stream request from a client that never reads its socket (the smallest receive buffer)."""
    raw = json.dumps({**body, "stream": True}).encode()
    connection = socket.socket()
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    connection.connect(("127.0.0.1", port))
    connection.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(raw)}\r\n\r\n".encode() + raw)
    return connection


@pytest.mark.parametrize("fields", [
    {"n": 2, "logprobs": 3},
    {"stop": ["zzz"], "logprobs": 1},
    {"n": 2, "stop": ["qq", "zz"]},
])
def test_clients_hanging_up_mid_stream_give_every_row_back(session, monkeypatch, fields):
    with Server(session, port=0, max_batch_size=2) as made:
        slow_batcher_steps(monkeypatch, 0.05)  # 40 tokens take a second or more: each is cancelled running
        for _ in range(3):
            connection = stalled_stream(made.port, {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, **fields})
            connection.recv(1)  # it runs
            connection.close()
        wait_for(lambda: metric(made.url, "running_requests") == 0 and metric(made.url, "queue_depth") == 0)
        assert metric(made.url, 'requests_finished_total{reason="cancelled"}') == 3 * fields.get("n", 1)
        monkeypatch.undo()
        everyone = {"prompt": PROMPT, "max_tokens": 4}  # the batch's two rows, taken at once
        answers = [complete(made.url, everyone, timeout=10) for _ in range(2)]
        assert [a.text for a in answers] == [session.generate(PROMPT, max_new_tokens=4)] * 2


def test_a_client_hanging_up_during_its_prefill_gives_its_row_back(session, monkeypatch):
    with Server(session, port=0, max_batch_size=1) as made:
        inside, release = hold_admission(monkeypatch)  # after the warm-up's admissions
        connection = stalled_stream(made.port, {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, "n": 1})
        assert inside.wait(10)
        connection.close()
        time.sleep(0.3)  # Starlette sees the disconnect and cancels the job inside add_requests
        release.set()
        wait_for(lambda: metric(made.url, "running_requests") == 0)
        assert metric(made.url, 'requests_finished_total{reason="cancelled"}') == 1
        serving(made, session)


@pytest.fixture
def small_buffers(monkeypatch):
    """The server's sockets buffer a few KiB before a write waits (the kernel's and asyncio's
    buffers, 64 KiB and more, take a whole answer of the tiny model)."""
    made = limits.HeaderTimer.connection_made

    def connection_made(self, transport):
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        transport.set_write_buffer_limits(high=4096)
        made(self, transport)

    monkeypatch.setattr(limits.HeaderTimer, "connection_made", connection_made)


def test_a_client_that_stops_reading_is_closed_after_the_send_timeout(session, small_buffers):
    """Its answer would wait in the server's memory (and its connection stay open) for as long as
    the client kept the socket; past --send-timeout the connection closes instead, and other
    clients are served meanwhile."""
    with Server(session, port=0, max_batch_size=2, send_timeout=1.0) as made, Records() as records:
        body = {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, "n": 2, "logprobs": 5}
        stalled = [stalled_stream(made.port, body) for _ in range(3)]
        other = complete(made.url, {"prompt": PROMPT, "max_tokens": 5}, timeout=10)
        assert other.status == 200 and other.text == session.generate(PROMPT, max_new_tokens=5)
        time.sleep(2.5)  # 1 s past the first write that waited, and slack
        for connection in stalled:
            connection.settimeout(5)
            received = b""
            try:
                received = b"".join(iter(lambda: connection.recv(65536), b""))  # noqa: B023
            except ConnectionResetError:
                pass
            except socket.timeout:  # the whole answer came, and the connection is still open
                pytest.fail("the server kept the connection of a client that did not read")
            assert b"data: [DONE]" not in received
            connection.close()
        assert any("--send-timeout" in r.getMessage() for r in records.records)
        wait_for(lambda: metric(made.url, "running_requests") == 0)
        serving(made, session)


def test_the_send_timeout_is_checked(session):
    from ortspec.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=r"send_timeout=0 must be a number of seconds > 0 \(--send-timeout\)"):
        Server(session, port=0, send_timeout=0)


# -- the engine process killed under requests --------------------------------------------------
def test_a_killed_engine_process_fails_its_requests_by_id_in_the_log(tokenized_model, session):
    """A request waiting on the engine gets a 500 JSON body, a stream an error event; each names
    its request id, and the server log has a line under that id (what the 500 promises)."""
    with Server.spawned(tokenized_model, dict(num_speculative_tokens=2), port=0, max_batch_size=2,
                        max_queue=8) as made, Records() as records:
        child = made.engine._process.pid  # noqa: SLF001
        os.kill(child, signal.SIGSTOP)  # the requests below are sent to it, and wait there
        replies: list = []
        bodies = [{"prompt": PROMPT, "max_tokens": 8}, {"prompt": PROMPT, "max_tokens": 8, "n": 2},
                  {"prompt": PROMPT, "max_tokens": 8, "stream": True}]
        asking = [threading.Thread(target=lambda b=b: replies.append(complete(made.url, b, timeout=60)))
                  for b in bodies]
        for thread in asking:
            thread.start()
        wait_for(lambda: made.engine.queue_depth == 4)
        os.kill(child, signal.SIGKILL)
        for thread in asking:
            thread.join(60)
        assert sorted(r.status for r in replies) == [200, 500, 500]  # the stream's headers were out
        ids = [re.search(r"request (cmpl-\w+)", r.error)[1] for r in replies]
        logged = " ".join(r.getMessage() for r in records.records if r.levelno >= logging.ERROR)
        assert all(i in logged for i in ids), logged
        wait_for(lambda: get(made.url, "/health")[0] == 200, 60)
        again = complete(made.url, {"prompt": PROMPT, "max_tokens": 6}, timeout=30)
        assert again.status == 200 and again.text == session.generate(PROMPT, max_new_tokens=6)
