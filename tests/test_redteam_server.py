"""Red-team findings on ortspec serve, as unseen clients hit them: routes and methods the server
does not serve (Starlette's plain-text 404/405, now OpenAI error bodies), fields that change
nothing refused (response_format text, an empty logit_bias) and fields that change what is
generated silently ignored (functions, function_call, tool_choice), 429 and 503 at submit not
counted in /metrics, messages in Python's words (type names, reprs, True/None), a length error naming the
Python API's max_new_tokens, malformed HTTP framing answered by uvicorn in plain text (and, on
httptools, the responses owed to requests pipelined before it lost). Each gets its answer and the
server goes on serving."""

from __future__ import annotations

import json
import logging
import re
import threading

import pytest

from ortspec.serve.server import Server
from tests.test_hostile_server import hold_admission, post, send, serving, strict  # noqa: F401  (a fixture)
from tests.test_serve import metric, server, wait_for  # noqa: F401  (server: a fixture)
from tools.serve_load import complete


def answer(port: int, method: str, route: str) -> tuple[int, dict, str]:
    reply = send(port, f"{method} {route} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
    head, _, payload = reply.partition(b"\r\n\r\n")
    headers = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:])
    headers = {name.lower(): value for name, value in headers.items()}
    assert headers["content-type"] == "application/json", head
    return int(head.split()[1]), json.loads(payload)["error"], headers.get("allow", "")


@pytest.mark.parametrize("method,route,status,match", [
    ("GET", "/v1/embeddings", 404, r"there is no route GET /v1/embeddings; this server serves POST /v1/completions"),
    ("POST", "/v2/completions", 404, r"no route POST /v2/completions"),
    ("GET", "/v1/models/x", 404, r"no route GET /v1/models/x"),
    ("GET", "/v1/completions", 405, r"GET /v1/completions is not served; /v1/completions takes POST"),
    ("OPTIONS", "/v1/chat/completions", 405, r"OPTIONS /v1/chat/completions is not served; .* takes POST"),
    ("POST", "/health", 405, r"POST /health is not served; /health takes .*GET"),
])
def test_a_route_or_method_not_served_gets_an_openai_error_body(server, session, method, route, status, match):
    got, error, allow = answer(server.port, method, route)
    assert got == status and error["code"] == status and re.search(match, error["message"]), error
    assert error["type"] in ("not_found_error", "invalid_request_error")
    assert (status != 405) or "POST" in allow or "GET" in allow  # 405 still names the methods in Allow
    serving(server, session)


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "text"}}, {"logit_bias": {}}, {"tool_choice": "none"}, {"tool_choice": "auto"},
    {"function_call": "none"}, {"functions": []}, {"tools": []}, {"presence_penalty": 0.0}, {"best_of": 1.0},
])
def test_a_field_that_changes_nothing_is_served(server, session, fields):
    status, reply = post(server.port, json.dumps({"prompt": "def f(", "max_tokens": 5, **fields}).encode())
    assert status == 200, reply
    assert reply["choices"][0]["text"] == session.generate("def f(", max_new_tokens=5)


@pytest.mark.parametrize("fields,match", [
    ({"functions": [{"name": "f", "parameters": {}}]}, r"functions=.* is not supported by ortspec serve; leave it out\."),
    ({"function_call": {"name": "f"}}, r"function_call=.* is not supported.*or send \"none\""),
    ({"tool_choice": "required"}, r"tool_choice=\"required\" is not supported.*or send \"none\""),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, r"tool_choice=.* is not supported"),
    ({"response_format": {"type": "json_object"}}, r"response_format=.* or send \{\"type\": \"text\"\}"),
    ({"logit_bias": {"5": 100}}, r"logit_bias=\{\"5\": 100\} is not supported"),
    ({"best_of": True}, r"best_of=true is not supported.*or send 1"),
    ({"logit_bias": []}, None),  # empty, of either kind: nothing to apply
])
def test_a_field_that_would_change_the_output_is_refused(server, session, fields, match):
    status, reply = post(server.port, json.dumps({"prompt": "def f(", "max_tokens": 5, **fields}).encode())
    if match is None:
        assert status == 200, reply
    else:
        assert status == 400 and re.search(match, reply["error"]["message"]), reply
    serving(server, session)


def test_the_length_error_names_max_tokens(server, session):
    length = session.manifest.max_length
    status, reply = post(server.port, json.dumps({"prompt": "def f(", "max_tokens": length}).encode())
    message = reply["error"]["message"]
    assert status == 400 and "max_new_tokens" not in message, message
    assert re.search(rf"with max_tokens={length} that is \d+ > max_length={length}.* lower max_tokens", message)


@pytest.mark.parametrize("body,kind", [(b"[]", "an array"), (b"null", "a null"), (b'"a"', "a string"),
                                       (b"5", "a number"), (b"true", "a boolean")])
def test_a_body_that_is_not_an_object_is_named_in_json_terms(server, body, kind):
    status, reply = post(server.port, body)
    assert status == 400 and f"the body is a JSON {kind.split()[1]}; send a JSON object" in reply["error"]["message"]


@pytest.fixture(scope="module")
def chat_server(session):
    """A server whose model has a chat template (the fixture model has none: give it one)."""
    from ortspec.serve import chat as chat_module
    from ortspec.serve.server import Server

    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chat_module.ChatTemplate, "from_model_dir", classmethod(lambda cls, _: cls(template)))
        with Server(session, port=0, max_batch_size=2) as s:
            yield s


@pytest.mark.parametrize("messages", [
    lambda n: [{"role": "r" * n, "content": ""}],  # the bound counted the contents alone
    lambda n: [{"role": "u", "content": ""}] * (n // 4 + 1),  # "u: \n" a message
])
def test_a_chat_prompt_past_the_character_bound_gets_413_before_tokenizing(chat_server, session, monkeypatch, messages):
    """The rendered prompt is bounded as a completion's prompt is: tokenizing it holds the GIL (a
    14 MiB body of empty messages held the event loop 4.5 s, and the engine with it in one process)."""
    limit = chat_server.limits.max_prompt_chars
    tokenized, new_requests = [], session.new_requests
    monkeypatch.setattr(session, "new_requests", lambda *a, **k: tokenized.append(1) or new_requests(*a, **k))
    body = json.dumps({"messages": messages(limit), "max_tokens": 2}).encode()
    status, reply = post(chat_server.port, body, route="/v1/chat/completions")
    assert status == 413 and re.search(rf"the chat prompt \(the messages rendered with the model's template\) has "
                                       rf"\d+ characters, more than this server takes \({limit}, --max-prompt-chars\)",
                                       reply["error"]["message"]), reply
    assert not tokenized
    monkeypatch.undo()
    status, reply = post(chat_server.port, json.dumps({"messages": [{"role": "user", "content": "def f("}],
                                                       "max_tokens": 3}).encode(), route="/v1/chat/completions")
    assert status == 200 and len(reply["choices"][0]["token_ids"]) == 3


def replies(raw: bytes) -> list[tuple[int, dict, bytes]]:
    """(status, headers, body) of each response in what a connection received (each with a Content-Length)."""
    answers = []
    while raw:
        head, _, raw = raw.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = {name.lower(): value for name, value in (line.split(": ", 1) for line in lines[1:])}
        length = int(headers["content-length"])
        answers.append((int(lines[0].split()[1]), headers, raw[:length]))
        raw = raw[length:]
    return answers


def refused_framing(reply: bytes, reason: str) -> None:
    """The last response is our 400 for a request the HTTP parser refused, ending the connection."""
    status, headers, body = replies(reply)[-1]
    error = json.loads(body)["error"]
    assert status == 400 and headers["content-type"] == "application/json" and headers["connection"] == "close"
    assert error["code"] == 400 and error["type"] == "invalid_request_error", error
    assert re.search(rf"the request is not valid HTTP/1\.1 \({reason}\); check its request line", error["message"])
    assert "bytearray" not in error["message"], error  # h11 appends the bytes as Python shows them


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
MALFORMED = {  # request -> its reason, (httptools', h11's)
    "a Content-Length of letters": (HEAD + b"Content-Length: abc\r\n\r\n{}",
                                    ("Invalid character in Content-Length", "bad Content-Length")),
    "two Content-Lengths": (HEAD + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
                            ("Duplicate Content-Length", "conflicting Content-Length headers")),
    "a chunk size that is not hexadecimal": (HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
                                             ("Invalid character in chunk size", "illegal chunk header")),
    "a header line without a colon": (b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
                                      ("Invalid header token", "illegal header line")),
    "a request line that is not one": (b"GARBAGE\r\n\r\n", ("Invalid method encountered", "illegal request line")),
    "a TLS hello on the plain port": (bytes.fromhex("1603010200010001fc0303"),
                                      ("Invalid method encountered", "illegal request line")),
    "a URL httptools cannot parse": (b"CONNECT evil:443 HTTP/1.1\r\nHost: x\r\n\r\n",  # h11: a route, 404
                                     ("invalid url", None)),
}


@pytest.mark.parametrize("what", list(MALFORMED))
def test_malformed_http_gets_an_openai_error_body_and_the_connection_closes(strict, session, what):
    raw, reasons = MALFORMED[what]
    reason = reasons[strict.parser == "h11"]
    if reason is None:
        pytest.skip(f"{strict.parser} reads it")
    refused_framing(send(strict.port, raw, timeout=10), reason)  # send: read to the close
    serving(strict, session)


def test_a_refused_request_pipelined_behind_others_is_answered_after_them(strict, session):
    """httptools parses pipelined requests as they arrive: uvicorn wrote its 400 for the broken one
    at once and closed, and the requests before it lost their responses."""
    body = json.dumps({"prompt": "def f(", "max_tokens": 4}).encode()
    request = HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    broken_chunk = HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\nzz\r\n"
    want = session.generate("def f(", max_new_tokens=4)
    for after, reasons in [(b"GARBAGE\r\n\r\n", MALFORMED["a request line that is not one"][1]),
                           (broken_chunk, MALFORMED["a chunk size that is not hexadecimal"][1])]:
        reply = send(strict.port, request + request + after, timeout=30)
        answered = replies(reply)
        assert [status for status, _, _ in answered] == [200, 200, 400], reply[:200]
        assert all(json.loads(payload)["choices"][0]["text"] == want for _, _, payload in answered[:2])
        refused_framing(reply, reasons[strict.parser == "h11"])
    serving(strict, session)


def test_refusals_at_submit_are_counted_by_status(session, monkeypatch):
    """A 429 (queue full) and a 503 (no engine takes jobs) never reach the engine's queue; /metrics
    counted neither, so an operator saw nothing of a server turning clients away."""
    with Server(session, port=0, max_batch_size=1, max_queue=1) as server:
        inside, release = hold_admission(monkeypatch)
        clients = [threading.Thread(target=complete, args=(server.url, {"prompt": "a", "max_tokens": 2}),
                                    kwargs={"timeout": 30}) for _ in range(2)]
        clients[0].start()
        assert inside.wait(30)  # being admitted: its row is taken
        clients[1].start()
        wait_for(lambda: metric(server.url, "queue_depth") == 1)  # and the queue's one slot
        refused = [complete(server.url, {"prompt": "a", "max_tokens": 2}, timeout=30) for _ in range(2)]
        assert [reply.status for reply in refused] == [429, 429]
        release.set()
        for client in clients:
            client.join()
        server.engine.stop()  # the server stopping: no engine takes jobs
        assert complete(server.url, {"prompt": "a", "max_tokens": 2}, timeout=30).status == 503
        assert metric(server.url, 'requests_finished_total{reason="429"}') == 2
        assert metric(server.url, 'requests_finished_total{reason="503"}') == 1
        assert metric(server.url, 'requests_finished_total{reason="length"}') == 2


PYTHON_WORDING = re.compile(r"\b(None|True|False|NoneType|str|int|float|bool|dict|tuple|bytearray|Traceback)\b"
                            r"|\b(list|dict|tuple|set)\[|\ba list\b|='|\bsys\.")


def in_json_terms(message: str) -> bool:
    """Whether a message a client gets avoids Python's words: its types, reprs (a str in single quotes),
    True / False / None (JSON's strings in it, which echo what was sent, are not looked at; nor is one
    cut short, ending in "...")."""
    return not PYTHON_WORDING.search(re.sub(r'"(?:[^"\\]|\\.)*(?:"|\.\.\.)', '""', message))


@pytest.mark.parametrize("fields,match", [
    ({"temperature": "hot"}, r'temperature="hot" must be a number; got a string\.'),
    ({"top_k": 1.5}, r"top_k=1.5 must be an integer, written without a fraction or exponent\."),
    ({"seed": [1]}, r"seed=\[1\] must be an integer; got an array\."),
    ({"seed": -1}, r"seed=-1 must be an integer >= 0; leave it out for a random seed\."),
    ({"max_tokens": True}, r"max_tokens=true must be an integer; got a boolean\."),
    ({"max_tokens": 2**64}, r"max_tokens=18446744073709551616 exceeds 9223372036854775807, the largest integer"),
    ({"stream": "yes"}, r'stream="yes" must be true or false; got a string\.'),
    ({"echo": 0}, r"echo=0 must be true or false; got a number\."),
    ({"stream_options": {"include_usage": {}}}, r"stream_options.include_usage=\{\} must be true or false; got an obj"),
    ({"stop": {"a": 1}}, r'stop=\{"a": 1\} must be a string or an array of non-empty strings'),
    ({"stop": ["", "x"]}, r'stop=\["", "x"\] must be a string or an array of non-empty strings'),
    ({"prompt": []}, r"prompt=\[\] must be a non-empty string or a non-empty array of token ids \(integers\)"),
    ({"prompt": None, "messages": 1}, r'the body has no "prompt"'),
])
def test_a_wrong_field_is_named_in_json_terms(server, session, fields, match):
    status, reply = post(server.port, json.dumps({"prompt": "def f(", "max_tokens": 5, **fields}).encode())
    message = reply["error"]["message"]
    assert status == 400 and re.search(match, message) and in_json_terms(message), message
    serving(server, session)


@pytest.mark.parametrize("raw,match", [
    (b'{"prompt": "a", "temperature": NaN}', r"the body holds NaN, which is not JSON"),
    (b'{"prompt": "a", "top_p": -Infinity}', r"the body holds -Infinity, which is not JSON"),
    (b'{"prompt": "a", "temperature": 1e400}', r"the number 1e400, beyond the largest this server parses"),
    (b'{"prompt": "a", "seed": ' + b"7" * 4400 + b"}", r"an integer of 4400 digits, more than this server parses"),
    (b"  ", r"the body is empty; send a JSON object"),
])
def test_a_body_json_does_not_have_is_refused_in_json_terms(server, raw, match):
    """Python's parser takes NaN and Infinity (and reads 1e400 as infinity); an integer past its
    4300 digits was refused with a message naming sys.set_int_max_str_digits."""
    status, reply = post(server.port, raw)
    message = reply["error"]["message"]
    assert status == 400 and re.search(match, message) and in_json_terms(message), message


@pytest.fixture(scope="module")
def untokenized(models):
    """A server over a model without tokenizer.json (token ids only)."""
    import ortspec

    with ortspec.Session(models.converted("base")) as plain, Server(plain, port=0, max_batch_size=1) as s:
        yield s


@pytest.mark.parametrize("fields,match", [
    ({"prompt": "def f("}, r"has no tokenizer.json, so text cannot be encoded; send /v1/completions a prompt of "
                           r"token ids: an array of integers"),
    ({"prompt": [1, 2], "stop": "x"}, r"has no tokenizer.json, so stop strings cannot be matched.*leave stop out"),
])
def test_a_model_without_a_tokenizer_names_what_to_send(untokenized, fields, match):
    """The Python API's messages named list[int] and stop_tokens, which no body has."""
    status, reply = post(untokenized.port, json.dumps({"max_tokens": 2, **fields}).encode())
    message = reply["error"]["message"]
    assert status == 400 and re.search(match, message) and in_json_terms(message), message
    assert complete(untokenized.url, {"prompt": [1, 2], "max_tokens": 2}, timeout=30).status == 200


TOOL_TEMPLATE = ("{% for m in messages %}{{ m.role + ': ' + m.content }}{% for t in m.tool_calls or [] %}"
                 "{{ t.function.name + '()' }}{% endfor %}\n{% endfor %}assistant:")  # as Qwen's writes tool calls


@pytest.fixture(scope="module")
def tool_chat_server(session):
    from ortspec.serve import chat as chat_module

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chat_module.ChatTemplate, "from_model_dir", classmethod(lambda cls, _: cls(TOOL_TEMPLATE)))
        with Server(session, port=0, max_batch_size=2) as s:
            yield s


@pytest.mark.parametrize("tool_calls,match", [
    ([{"function": {"name": 5}}], r"a field holds a value of a type it cannot use there"),  # was a 500 (TypeError)
    ([{"nofunction": 1}], r"failed on these messages: an object has no attribute 'function'"),
    ("f", r"failed on these messages: a string has no attribute 'function'"),
])
def test_a_chat_template_failing_on_a_field_is_a_400_in_json_terms(tool_chat_server, session, tool_calls, match):
    body = {"messages": [{"role": "assistant", "content": "x", "tool_calls": tool_calls}], "max_tokens": 2}
    status, reply = post(tool_chat_server.port, json.dumps(body).encode(), route="/v1/chat/completions")
    message = reply["error"]["message"]
    assert status == 400 and re.search(match, message) and in_json_terms(message), message
    body["messages"][0]["tool_calls"] = [{"function": {"name": "f"}}]
    status, reply = post(tool_chat_server.port, json.dumps(body).encode(), route="/v1/chat/completions")
    assert status == 200 and len(reply["choices"][0]["token_ids"]) == 2


def test_a_websocket_upgrade_is_answered_as_http(strict, session):
    """The server has no WebSocket routes; uvicorn's WebSocket protocol answered an upgrade with a
    bare 403. Without it the request is served as the HTTP request it also is."""
    from tests.test_hostile_server import Records

    with Records() as log:
        reply = send(strict.port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                     b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n", timeout=10)
    [(status, headers, body)] = replies(reply)
    assert status == 200 and json.loads(body)["status"] == "ok", reply[:200]
    assert not [r for r in log.records if r.levelno >= logging.WARNING], [r.getMessage() for r in log.records]
    serving(strict, session)
