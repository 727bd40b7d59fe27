"""ortspec serve against a careless or hostile client (issue 21): fields beyond int64, huge
numbers, unpaired surrogates, deep nesting; planted failures in admission and in a step; huge,
slow and half-sent bodies; slow headers; clients that hang up; bad server options. Each gets a
4xx (or a 500 naming the request id) and the server goes on serving."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import sys
import threading
import time

import pytest

from ortspec import cli
from ortspec.errors import ConfigurationError
from ortspec.serve import limits
from ortspec.serve.app import INLINE_CHECK_BYTES
from ortspec.serve.limits import Limits
from ortspec.serve.server import Server
from ortspec.speculative.batcher import Batcher
from tools.serve_load import complete, get

from tests.test_serve import Gate, metric, server, wait_for  # noqa: F401  (server: a fixture)


def send(port: int, raw: bytes, timeout: float = 30.0) -> bytes:
    """Sends raw bytes on a new connection and reads until the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as connection:
        connection.sendall(raw)
        return b"".join(iter(lambda: connection.recv(65536), b""))


def post(port: int, body: bytes, route: str = "/v1/completions", headers: str = "") -> tuple[int, dict]:
    head = (f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"{headers}Connection: close\r\n\r\n")
    reply = send(port, head.encode() + body)
    status, _, payload = reply.partition(b"\r\n\r\n")
    return int(status.split()[1]), json.loads(payload or b"{}")


def hold_admission(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Holds every admission (add_requests) until `release` is set; `inside` is set once one is held."""
    add, inside, release = Batcher.add_requests, threading.Event(), threading.Event()

    def held_add(self, requests, **options):
        inside.set()
        release.wait(30)
        return add(self, requests, **options)

    monkeypatch.setattr(Batcher, "add_requests", held_add)
    return inside, release


def serving(server, session) -> None:
    """The server still answers, and as Session.generate does."""
    assert json.loads(get(server.url, "/health")[1])["status"] == "ok"
    reply = complete(server.url, {"prompt": "def f(", "max_tokens": 5}, timeout=30)
    assert reply.status == 200 and reply.text == session.generate("def f(", max_new_tokens=5)


class Records(logging.Handler):
    """The log records of ortspec.serve and uvicorn while in use."""

    NAMES = ("ortspec.serve", "uvicorn.error")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record) -> None:
        self.records.append(record)

    def __enter__(self) -> "Records":
        for name in self.NAMES:
            logging.getLogger(name).addHandler(self)
        self.saved_level = logging.getLogger("ortspec.serve").level
        logging.getLogger("ortspec.serve").setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        for name in self.NAMES:
            logging.getLogger(name).removeHandler(self)
        logging.getLogger("ortspec.serve").setLevel(self.saved_level)

    def tracebacks(self) -> list[logging.LogRecord]:
        return [r for r in self.records if r.exc_info]


FIELDS = [
    (b'{"prompt": "def f(", "max_tokens": 4, "temperature": 0.7, "top_k": 9223372036854775808}',
     r"top_k=9223372036854775808 exceeds 9223372036854775807"),
    (b'{"prompt": "a", "temperature": 0.7, "seed": 18446744073709551616}', r"seed=18446744073709551616 exceeds"),
    (b'{"prompt": "a", "max_tokens": 1000000000000000000000000}', r"max_tokens=1000000000000000000000000 exceeds"),
    (b'{"prompt": "a", "temperature": 1e39}', r"finite as a float32"),
    (b'{"prompt": "a", "temperature": 1' + b"0" * 400 + b"}", r"temperature=1000.* must be a finite number"),
    (b'{"prompt": "def \\ud800("}', r"unpaired surrogate U\+D800 at character 4"),
    (b'{"prompt": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", r"deeper than the JSON parser goes"),
    (b'{"prompt": "a", "x": ' + b"[" * 40 + b"]" * 40 + b"}", r"more than 32 levels deep"),
    (b'{"prompt": "a", "stream": true, "stream_options": {"include_usage": "no"}}',
     r"stream_options.include_usage=\"no\" must be true or false; got a string"),
    (b'{"prompt": "a", "stream_options": false}', r"stream_options=false must be an object"),
    (b'{"prompt": "a", "model": {}}', r"model=\{\} must be a string"),
    (b'{"prompt": [["a"]]}', r"prompt=\[\[\"a\"\]\] must be a non-empty string or a non-empty array of token ids"),
    (b'{"prompt": 5}', r"prompt=5 must be a non-empty string"),
    (b'{"prompt": {"text": "a"}}', r"must be a non-empty string or a non-empty array of token ids"),
]


@pytest.mark.parametrize("body,match", FIELDS, ids=[f"{n}:{body[:40]!r}" for n, (body, _) in enumerate(FIELDS)])
def test_hostile_fields_get_400_and_the_engine_lives(server, session, body, match):
    status, reply = post(server.port, body)
    assert status == 400 and re.search(match, reply["error"]["message"]), reply
    serving(server, session)


def test_a_json_integer_temperature_is_served(server):
    reply = complete(server.url, {"prompt": "a", "max_tokens": 3, "temperature": 10**24, "seed": 3}, timeout=30)
    assert reply.status == 200 and len(reply.token_ids) == 3


def test_null_fields_mean_their_defaults(server, session):
    reply = complete(server.url, {"prompt": "def f(", "max_tokens": None, "temperature": None, "stop": None,
                                  "stream_options": None}, timeout=30)
    assert reply.status == 200 and reply.text == session.generate("def f(", max_new_tokens=16)


def test_a_planted_step_failure_fails_the_running_requests_and_the_server_goes_on(session, monkeypatch):
    with Server(session, port=0, max_batch_size=2) as server, Records() as log:
        first_batcher, step, failures = server.engine.batcher, Batcher.step, [1]

        def failing_step(self):
            if failures:
                failures.pop()
                raise RuntimeError("planted step failure")
            return step(self)

        monkeypatch.setattr(Batcher, "step", failing_step)
        reply = complete(server.url, {"prompt": "a", "max_tokens": 8}, timeout=30)
        assert reply.status == 500
        request_id = re.search(r"request (cmpl-\w+)", reply.error).group(1)
        assert "the server log has its traceback under this id" in reply.error
        [failed] = log.tracebacks()
        assert request_id in failed.getMessage() and "planted step failure" in str(failed.exc_info[1])
        wait_for(lambda: server.engine.batcher is not first_batcher)  # replaced after the failed jobs are answered
        assert first_batcher.closed  # its states are never stepped again
        serving(server, session)
        assert metric(server.url, 'requests_finished_total{reason="500"}') == 1


def test_a_planted_admission_failure_fails_that_request_alone(session, monkeypatch):
    with Server(session, port=0, max_batch_size=2) as server, Records() as log:
        add, failures = Batcher.add_requests, [1]

        def failing_add(self, requests, **options):
            if failures and requests[0]["prompt"] == [0, 1, 2]:
                failures.pop()
                raise OverflowError("planted admission failure")
            return add(self, requests, **options)

        monkeypatch.setattr(Batcher, "add_requests", failing_add)
        results = {}
        beside = threading.Thread(target=lambda: results.update(beside=complete(
            server.url, {"prompt": "def f(", "max_tokens": 30, "stream": True}, timeout=30)))
        beside.start()
        reply = complete(server.url, {"prompt": [0, 1, 2], "max_tokens": 4}, timeout=30)
        beside.join()
        assert reply.status == 500 and "internal error while serving request cmpl-" in reply.error
        assert results["beside"].text == session.generate("def f(", max_new_tokens=30)  # unharmed
        assert "planted admission failure" in str(log.tracebacks()[0].exc_info[1])
        serving(server, session)
        assert server.engine.error is None and metric(server.url, "running_requests") == 0


def slow_batcher_steps(monkeypatch, seconds: float) -> None:
    """Every batcher step takes `seconds` longer: requests stay running while a test acts."""
    step = Batcher.step

    def slow_step(self):
        time.sleep(seconds)
        return step(self)

    monkeypatch.setattr(Batcher, "step", slow_step)


def test_a_non_streamed_request_is_cancelled_when_its_client_hangs_up(session, monkeypatch):
    with Server(session, port=0, max_batch_size=1) as server, Records() as log:
        slow_batcher_steps(monkeypatch, 0.1)
        raw = json.dumps({"prompt": "a", "max_tokens": 40}).encode()
        connection = socket.create_connection(("127.0.0.1", server.port))
        connection.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
                           + raw)
        wait_for(lambda: metric(server.url, "running_requests") == 1)
        connection.close()  # tokens keep arriving for the handler meanwhile: it must still notice
        wait_for(lambda: metric(server.url, "running_requests") == 0)
        assert metric(server.url, 'requests_finished_total{reason="cancelled"}') == 1
        assert metric(server.url, 'requests_finished_total{reason="length"}') == 0
        assert any("the client disconnected; its request is cancelled" in r.getMessage() for r in log.records)
        assert not log.tracebacks()


def test_the_queue_full_message_counts_a_request_being_admitted(session, monkeypatch):
    with Server(session, port=0, max_batch_size=1, max_queue=1) as server:
        inside, release = hold_admission(monkeypatch)
        replies = []
        clients = [threading.Thread(target=lambda: replies.append(complete(server.url, {"prompt": "a", "max_tokens": 2},
                                                                          timeout=30))) for _ in range(2)]
        clients[0].start()
        assert inside.wait(30)  # the first is being admitted: out of the queue, not yet in a row
        clients[1].start()
        wait_for(lambda: metric(server.url, "queue_depth") == 1)
        refused = complete(server.url, {"prompt": "a", "max_tokens": 2}, timeout=30)
        release.set()
        for client in clients:
            client.join()
        assert refused.status == 429 and "all 1 queue slots are taken (1 request running)" in refused.error
        assert [r.status for r in replies] == [200, 200]


def test_a_timeout_shorter_than_a_turn_still_gets_the_first_token(server):
    reply = complete(server.url, {"prompt": "a", "max_tokens": 40, "timeout": 1e-9}, timeout=30)
    assert reply.status == 200 and reply.finish_reason == "timeout" and 1 <= len(reply.token_ids) < 40


UNIMPORTABLE = {"httptools": (), "h11": ("httptools", "uvloop")}  # per HTTP parser: the modules hidden to get it


@contextlib.contextmanager
def http_stack(parser: str):
    """Servers made inside pick `parser` (h11: the fallback where httptools and uvloop do not import)."""
    with pytest.MonkeyPatch.context() as patch:
        for name in UNIMPORTABLE[parser]:
            patch.setitem(sys.modules, name, None)  # import raises ImportError
        yield


@pytest.fixture(scope="module", params=list(UNIMPORTABLE))
def strict(session, request):
    """A server with small limits, to reach them cheaply: on httptools and uvloop (what the serve
    extra installs), and on the fallback, h11 and asyncio."""
    with http_stack(request.param):
        made = Server(session, port=0, max_body_bytes=4096, body_timeout=1.0, header_timeout=1.0)
    assert (made.parser, made.loop) == {"httptools": ("httptools", "uvloop"), "h11": ("h11", "asyncio")}[request.param]
    with made as s:
        yield s


def test_a_streamed_request_is_served_on_either_stack(strict, session):
    reply = complete(strict.url, {"prompt": "def f(", "max_tokens": 12, "stream": True}, timeout=30)
    assert reply.status == 200 and reply.text == session.generate("def f(", max_new_tokens=12)
    assert len(reply.token_ids) == 12


def test_the_startup_line_names_the_parser_and_the_loop(tokenized_model, capsys, monkeypatch):
    monkeypatch.setattr(Server, "run", lambda self: None)
    for parser, named in [("httptools", "httptools on uvloop"), ("h11", "h11 on asyncio")]:
        with http_stack(parser):
            cli.main(["serve", str(tokenized_model), "--port", "0", "--engine", "thread"])
        assert named in capsys.readouterr().err


def test_a_body_over_the_limit_gets_413(strict, session):
    big = json.dumps({"prompt": "a" * 5000}).encode()
    status, reply = post(strict.port, big)
    assert status == 413 and "more than this server takes (4096, --max-body-bytes)" in reply["error"]["message"]
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(big[i:i + 1000]), big[i:i + 1000]) for i in range(0, len(big), 1000))
    reply = send(strict.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                 + chunked + b"0\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 413") and b"--max-body-bytes" in reply  # no Content-Length: counted
    serving(strict, session)


def test_a_prompt_over_the_character_bound_gets_413_before_tokenizing(server, session, monkeypatch):
    limit = server.limits.max_prompt_chars
    longest = max(map(len, session.tokenizer.get_vocab()))
    assert limit == 4 * session.manifest.max_length * longest
    tokenized = []
    monkeypatch.setattr(session.prompts, "token_prompts", lambda prompt: tokenized.append(prompt))
    for body, route in [({"prompt": "x" * (limit + 1)}, "/v1/completions")]:
        status, reply = post(server.port, json.dumps(body).encode(), route)
        assert status == 413 and f"more than this server takes ({limit}, --max-prompt-chars)" in \
            reply["error"]["message"]
    assert tokenized == []
    monkeypatch.undo()
    serving(server, session)


def test_a_body_of_millions_of_token_ids_gets_413_before_it_is_parsed(server, session, monkeypatch):
    parsed = []
    monkeypatch.setattr("ortspec.serve.protocol.parse_json", lambda raw: parsed.append(raw))
    start = time.monotonic()
    status, reply = post(server.port, json.dumps({"prompt": [1] * 4_000_000, "max_tokens": 2}).encode())  # 12 MB
    assert status == 413 and "commas, more JSON values than any request this model takes" in reply["error"]["message"]
    assert parsed == [] and time.monotonic() - start < 3.0  # seconds of CPU before; now a scan of the body
    monkeypatch.undo()
    max_length = session.manifest.max_length
    status, reply = post(server.port, json.dumps({"prompt": [1] * 2000, "max_tokens": 2}).encode())  # under the scan
    assert status == 413 and f"2000 token ids, more than the model's max_length ({max_length})" in \
        reply["error"]["message"]
    serving(server, session)


def test_a_large_legit_body_passes_the_comma_scan(session, monkeypatch):
    """Text of commas up to --max-prompt-chars, a long chat history, n and logprobs: the scan refuses none."""
    from ortspec.serve import chat

    from tests.test_serve import TEMPLATE

    monkeypatch.setattr(chat.ChatTemplate, "from_model_dir", classmethod(lambda cls, _: cls(TEMPLATE)))
    with Server(session, port=0, max_batch_size=4) as chatty:
        limit = chatty.limits.max_prompt_chars
        status, reply = post(chatty.port, json.dumps({"prompt": "," * limit, "max_tokens": 2}).encode())
        assert status == 400 and "commas" not in reply["error"]["message"]  # refused for its tokens, past max_length
        history = [{"role": "user", "content": ", ,"}] * (limit // 40)  # each renders to ~30 characters
        status, reply = post(chatty.port, json.dumps({"messages": history, "max_tokens": 2}).encode(),
                             "/v1/chat/completions")
        assert status == 400 and "commas" not in reply["error"]["message"], reply
        body = {"messages": [{"role": "user", "content": "a, b, c"}], "max_tokens": 3, "n": 2, "logprobs": True,
                "top_logprobs": 2, "stop": [";", "?"]}
        status, reply = post(chatty.port, json.dumps(body).encode(), "/v1/chat/completions")
        assert status == 200 and len(reply["choices"]) == 2, reply


def test_tokenizing_a_long_body_runs_off_the_event_loop(server, session, monkeypatch):
    """A body over INLINE_CHECK_BYTES is checked in a worker thread (a short one's check, bounded
    by its size, runs on the loop: a thread hop would cost it more)."""
    tokenize = session.prompts.token_prompts

    def slow_tokenize(prompt):
        time.sleep(1.5)
        return tokenize(prompt)

    monkeypatch.setattr(session.prompts, "token_prompts", slow_tokenize)
    body = b'{"prompt": "a", "max_tokens": 2}' + b" " * INLINE_CHECK_BYTES  # JSON's whitespace: over the bound
    slow = threading.Thread(target=post, args=(server.port, body))
    slow.start()
    time.sleep(0.3)  # the request is being tokenized now
    start = time.monotonic()
    assert json.loads(get(server.url, "/health")[1])["status"] == "ok"
    waited = time.monotonic() - start
    slow.join()
    assert waited < 1.0, f"/health waited {waited:.2f} s for a request's tokenizer"


def test_a_half_sent_body_gets_408_and_its_connection_closes(strict, session):
    start = time.monotonic()
    reply = send(strict.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
                 + b'{"prompt": ', timeout=10)
    assert reply.startswith(b"HTTP/1.1 408") and b"--body-timeout" in reply
    assert time.monotonic() - start < 8  # 1 s of body timeout, then the server closed the connection
    serving(strict, session)


@pytest.mark.parametrize("partial", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"])
def test_slow_headers_are_cut_off(strict, partial):
    start = time.monotonic()
    assert send(strict.port, partial, timeout=10) == b""  # closed by the server, nothing answered
    assert time.monotonic() - start < 8


def test_slow_headers_after_a_response_are_cut_off(strict):
    """The header timeout starts again at each response (uvicorn's keep-alive timer stops at the
    first byte of the next request)."""
    with socket.create_connection(("127.0.0.1", strict.port), timeout=10) as connection:
        reader = connection.makefile("rb")
        connection.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert reader.readline().startswith(b"HTTP/1.1 200 ")
        connection.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and no more
        rest = reader.read()  # the first response's rest, then the close (a socket timeout fails the test)
        assert rest.endswith(b"}"), rest[-80:]  # its JSON body, and nothing answered after it


def test_a_request_past_the_header_timeout_is_answered(strict, monkeypatch):
    """Its headers are in: the header timer is off until its response is out."""
    slow_batcher_steps(monkeypatch, 0.2)
    reply = complete(strict.url, {"prompt": "a", "max_tokens": 8, "stream": True}, timeout=30)  # 1.4 s or more
    assert reply.status == 200 and len(reply.token_ids) == 8 and reply.finish_reason == "length"


def test_a_slowly_trickled_header_is_cut_off(strict):
    with socket.create_connection(("127.0.0.1", strict.port), timeout=10) as connection:
        start = time.monotonic()
        with pytest.raises(OSError):
            for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: 1\r\n" * 40:  # all valid
                connection.sendall(bytes([byte]))
                time.sleep(0.05)
                assert time.monotonic() - start < 8
        assert time.monotonic() - start < 8


def headers_too_large(connection: socket.socket, parser: str) -> None:
    """Sends headers past MAX_HEADER_BYTES, with no end yet: the server answers and closes (on h11
    by its own bound, which uvicorn answered with a plain-text 400)."""
    connection.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000)
    reply = b"".join(iter(lambda: connection.recv(65536), b""))
    assert reply.startswith(b"HTTP/1.1 431 "), reply[:80]
    assert b"over 16384 bytes" in reply and b'"code": 431' in reply


def test_headers_past_the_bound_get_431_and_the_connection_closes(strict):
    with socket.create_connection(("127.0.0.1", strict.port), timeout=10) as connection:
        headers_too_large(connection, strict.parser)


def test_whole_headers_past_the_bound_get_431(strict):
    if strict.parser == "h11":
        pytest.skip("h11 bounds only headers still incomplete (a read may bring more whole)")
    reply = send(strict.port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n", timeout=10)
    assert reply.startswith(b"HTTP/1.1 431 ")


def test_the_bound_counts_each_request_on_a_connection_afresh(strict):
    """Requests within the bound (their headers and bodies together far past it) are served on one
    keep-alive connection; then one past it still gets refused there."""
    with socket.create_connection(("127.0.0.1", strict.port), timeout=10) as connection:
        reader = connection.makefile("rb")
        body = b'{"prompt": "a", "max_tokens": 1}' + b" " * 3000
        for head in [b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 15_000 + b"\r\n\r\n"] * 3 + [
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)] * 2:
            connection.sendall(head)
            assert reader.readline().startswith(b"HTTP/1.1 200 ")
            length = 0
            while (line := reader.readline()) != b"\r\n":
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            reader.read(length)
        headers_too_large(connection, strict.parser)


def test_a_client_gone_mid_body_is_one_log_line(strict):
    with Records() as log:
        with socket.create_connection(("127.0.0.1", strict.port)) as connection:
            connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro")
            time.sleep(0.3)
        wait_for(lambda: any("disconnected before its body arrived" in r.getMessage() for r in log.records))
        time.sleep(0.2)
        assert not log.tracebacks()


@pytest.mark.parametrize("parser", list(UNIMPORTABLE))
def test_a_connection_past_the_cap_gets_503_and_the_server_serves_after(session, parser):
    with http_stack(parser):
        capped = Server(session, port=0, max_connections=4, header_timeout=30.0)
    with capped, contextlib.ExitStack() as idle:
        held = [idle.enter_context(socket.create_connection(("127.0.0.1", capped.port))) for _ in range(4)]
        time.sleep(0.2)  # the server takes them in
        status, reply = post(capped.port, json.dumps({"prompt": "def f(", "max_tokens": 2}).encode())
        assert status == 503 and "(4, --max-connections)" in reply["error"]["message"]
        reply = send(capped.port, b"")  # no request at all: answered as it opens, closed after
        assert reply.startswith(b"HTTP/1.1 503") and reply.endswith(b"}")
        for connection in held:
            connection.close()
        wait_for(lambda: post(capped.port, json.dumps({"prompt": "def f(", "max_tokens": 2}).encode())[0] == 200)
        serving(capped, session)


def test_the_connection_cap_defaults_to_what_the_file_limit_allows(monkeypatch):
    monkeypatch.setattr(limits, "file_limit", lambda: 20000)
    assert Limits().max_connections == limits.MAX_CONNECTIONS == 4096
    monkeypatch.setattr(limits, "file_limit", lambda: 1024)
    assert Limits().max_connections == (1024 - limits.RESERVED_FILES) // 2 == 384
    with pytest.raises(ConfigurationError, match=r"max_connections=385 needs 1026 file descriptors .*ulimit -n"):
        Limits(max_connections=385)


@pytest.mark.parametrize("option,value,match", [
    ("--request-timeout", "nan", r"request_timeout=nan must be a number of seconds > 0 \(--request-timeout\)"),
    ("--request-timeout", "0", r"request_timeout=0.0 must be a number of seconds > 0"),
    ("--body-timeout", "inf", r"body_timeout=inf must be a number of seconds"),
    ("--header-timeout", "-1", r"header_timeout=-1.0 must be a number of seconds > 0"),
    ("--max-body-bytes", "0", r"max_body_bytes=0 must be an integer >= 1 \(--max-body-bytes\)"),
    ("--max-prompt-chars", "0", r"max_prompt_chars=0 must be an integer >= 1"),
    ("--max-batch-size", "0", r"max_batch_size=0 must be an integer >= 1"),
    ("--max-queue", "0", r"max_queue=0 must be an integer >= 1"),
    ("--max-connections", "0", r"max_connections=0 must be an integer >= 1 \(--max-connections\)"),
    ("--max-connections", str(2**40), r"max_connections=1099511627776 needs .* \(ulimit -n\)"),
])
def test_a_bad_server_option_exits_2_before_the_model_loads(tokenized_model, capsys, monkeypatch, option, value,
                                                            match):
    monkeypatch.setattr("ortspec.session.Session.__init__", lambda *a, **k: pytest.fail("the model was loaded"))
    assert cli.main(["serve", str(tokenized_model), option, value]) == 2
    assert re.search(match, capsys.readouterr().err)


def test_a_bad_server_option_is_refused_from_python_too(session):
    with pytest.raises(ConfigurationError, match="request_timeout=nan"):
        Server(session, port=0, request_timeout=float("nan"))


def test_serve_help_names_every_limit_and_its_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option, default in [("--request-timeout", "600.0"), ("--max-body-bytes", str(16 * 2**20)),
                            ("--body-timeout", "30.0"), ("--header-timeout", "10.0"), ("--send-timeout", "30.0"),
                            ("--max-queue", "64")]:
        assert re.search(re.escape(option) + r" \S+ .*?\(default: " + re.escape(default) + r"\)", text), option
    assert "--max-prompt-chars" in text and "4 x max_length x the longest token" in text
    assert "--max-connections" in text and "default: 4096" in text


def test_openapi_json_describes_the_routes(server):
    status, text = get(server.url, "/openapi.json")
    document = json.loads(text)
    assert status == 200 and document["openapi"].startswith("3.1")
    assert {"/health", "/metrics", "/v1/models", "/v1/completions"} <= set(document["paths"])
    properties = document["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stream", "timeout"} <= set(properties)


def test_a_batcher_that_cannot_be_reopened_stops_the_engine_and_answers_everyone(session, monkeypatch):
    """The one failure the engine does not survive: after a failed step, no new batcher. Every
    request out of the queue and in it is still answered, and /health says why."""
    with Server(session, port=0, max_batch_size=1) as server, Gate(server.engine, monkeypatch) as gate, Records():
        replies = {}
        running = threading.Thread(target=lambda: replies.update(running=complete(
            server.url, {"prompt": "a", "max_tokens": 30}, timeout=30)))
        running.start()
        wait_for(lambda: metric(server.url, "queue_depth") == 1)
        gate.one_turn()  # admitted and stepped
        wait_for(lambda: metric(server.url, "running_requests") == 1)
        queued = threading.Thread(target=lambda: replies.update(queued=complete(
            server.url, {"prompt": "b", "max_tokens": 3}, timeout=30)))
        queued.start()
        wait_for(lambda: metric(server.url, "queue_depth") == 1)

        def broken_step(self):
            raise RuntimeError("planted step failure")

        def no_batcher(**options):
            raise MemoryError("planted: no memory for a new batcher")

        monkeypatch.setattr(Batcher, "step", broken_step)
        monkeypatch.setattr(session, "batcher", no_batcher)
        gate.open()
        running.join()
        queued.join()
        assert replies["running"].status == 500 and "internal error while serving request" in replies["running"].error
        assert replies["queued"].status == 500 and "the engine failed: MemoryError" in replies["queued"].error
        status, text = get(server.url, "/health")
        assert status == 503 and "planted: no memory" in json.loads(text)["error"]
        assert complete(server.url, {"prompt": "a", "max_tokens": 2}, timeout=30).status == 503


def test_a_request_being_admitted_at_shutdown_is_answered(session, monkeypatch):
    with Server(session, port=0, max_batch_size=1) as server:
        inside, release = hold_admission(monkeypatch)
        replies = []
        client = threading.Thread(target=lambda: replies.append(complete(server.url, {"prompt": "a", "max_tokens": 30},
                                                                         timeout=30)))
        client.start()
        assert inside.wait(30)
        stopping = threading.Thread(target=server.engine.stop)
        stopping.start()
        release.set()
        stopping.join(30)
        client.join(30)
        assert not stopping.is_alive() and replies[0].status == 503 and "shutting down" in replies[0].error
