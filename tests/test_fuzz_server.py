"""Fuzzing ortspec serve (issue 21): hypothesis draws every request field of /v1/completions and
/v1/chat/completions, well-formed or hostile (wrong types, huge and non-finite numbers, unpaired
surrogates, nesting), against a live server on the tiny model. Every answer is a 2xx with a valid
body or a 4xx with an OpenAI error body in JSON's words, never a 5xx, and afterwards the server answers as
Session.generate does; with the engine in its own process and in a thread. Bounded: a few
seconds on two cores."""

from __future__ import annotations

import functools
import http.client
import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import ortspec
from ortspec.serve import chat as chat_module
from ortspec.serve.server import Server
from tools.serve_load import complete, get

from tests.test_redteam_server import in_json_terms

EXAMPLES = 120  # per route
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
FINISH_REASONS = {"stop", "length", "timeout"}


@pytest.fixture(scope="module", params=["process", "thread"])
def server(request, tokenized_model):
    """The engine in a process of its own (ortspec serve's default) and in a thread."""
    with pytest.MonkeyPatch.context() as patch:  # the fixture model has no chat template: give it one
        patch.setattr(chat_module.ChatTemplate, "from_model_dir", classmethod(lambda cls, _: cls(TEMPLATE)))
        options = dict(port=0, max_batch_size=2, max_queue=8)
        with ortspec.Session(tokenized_model, num_speculative_tokens=2) as session, \
                (Server.spawned(tokenized_model, dict(num_speculative_tokens=2), **options) if request.param == "process"
                 else Server(session, **options)) as s:
            yield s, session


# -- strategies: each field well-formed, wrong or hostile ------------------------------------------
surrogate = st.sampled_from(["\ud800", "\udfff", "\udc80x"])
texts = st.one_of(st.text(max_size=12), st.builds(lambda a, s, b: a + s + b, st.text(max_size=4), surrogate,
                                                  st.text(max_size=4)))
huge = st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**30, 10**300])
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-5, 600), huge, texts,
                      st.floats(allow_nan=True, allow_infinity=True))
json_any = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
                        max_leaves=6)
nested = st.integers(28, 36).map(lambda n: functools.reduce(lambda inner, _: [inner], range(n), []))  # the depth limit
token_ids = st.lists(st.one_of(st.integers(0, 511), st.integers(-3, 2**70), st.booleans(), st.floats()), max_size=6)
prompts = st.one_of(texts, token_ids, st.lists(texts, max_size=2), st.lists(token_ids, max_size=2), json_any, nested)
small_counts = st.one_of(st.integers(-2, 6), huge, st.floats(-1, 8), st.text(max_size=3), st.none(), st.booleans())
numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3), huge, st.none(), texts,
                    st.booleans())
HOSTILE = {  # per field: values of any kind, the valid ones among them
    "max_tokens": small_counts,
    "temperature": st.one_of(st.sampled_from([0, 0.0, 0.7, 1, 1.5, 1e-5, 10**24]), numbers),
    "top_p": st.one_of(st.sampled_from([1, 0.9, 0.5, 1e-50]), numbers),
    "top_k": st.one_of(st.integers(0, 600), huge, numbers),
    "seed": st.one_of(st.integers(0, 2**40), huge, numbers),
    "stream": st.one_of(st.booleans(), json_any),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.one_of(st.booleans(), json_any)}), json_any),
    "timeout": st.one_of(st.sampled_from([1e-9, 0.5, 30, 600, 601]), numbers),
    "n": st.one_of(st.just(1), json_any),
    "stop": st.one_of(st.none(), json_any),
    "logprobs": st.one_of(st.none(), st.integers(-1, 6), st.booleans(), json_any),
    "top_logprobs": st.one_of(st.integers(-1, 21), json_any),
    "echo": st.one_of(st.booleans(), json_any),
    "model": json_any,
    "unknown_field": json_any,
}
VALID = {  # per field: values the server serves
    "max_tokens": st.integers(1, 6),
    "temperature": st.one_of(st.just(0), st.floats(1e-4, 4), st.just(10**24)),
    "top_p": st.floats(1e-6, 1),
    "top_k": st.one_of(st.integers(0, 600), st.just(2**63 - 1)),
    "seed": st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "timeout": st.one_of(st.just(1e-9), st.floats(0.001, 600)),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=4)),
    "n": st.integers(1, 2),
}
hostile_field = st.sampled_from(sorted(HOSTILE)).flatmap(lambda name: HOSTILE[name].map(lambda value: {name: value}))
fields = st.builds(lambda valid, hostile: {k: v for d in [valid, *hostile] for k, v in d.items()},
                   st.fixed_dictionaries({}, optional=VALID), st.lists(hostile_field, max_size=2))
valid_prompts = st.one_of(st.text(st.characters(codec="utf-8"), min_size=1, max_size=12),
                          st.lists(st.integers(0, 511), min_size=1, max_size=6))
messages = st.one_of(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                    "content": st.text(st.characters(codec="utf-8"), max_size=12)}), min_size=1,
             max_size=3),
    st.lists(st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system"]), json_any),
                                    "content": st.one_of(texts, json_any)}), max_size=3),
    json_any)


def post(port: int, body, route: str) -> tuple[int, str, bytes]:
    raw = json.dumps(body, allow_nan=True)  # NaN and Infinity as Python's json writes them: the server must cope
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("POST", route, raw, {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read()
    finally:
        connection.close()


def check_answer(status: int, media: str, payload: bytes, chat: bool) -> None:
    event(f"HTTP {status}")
    assert status < 500, payload[:500]
    if status >= 400:
        error = json.loads(payload)["error"]
        code = "model_not_found" if status == 404 else status  # an unknown model, as OpenAI answers it
        assert isinstance(error["message"], str) and error["message"] and error["code"] == code
        assert in_json_terms(error["message"]), error["message"]  # no Python type names, reprs or None
        return
    assert status == 200
    if media.startswith("text/event-stream"):
        events = [line[6:] for line in payload.decode().split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        for chunk in map(json.loads, events[:-1]):
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                assert all(isinstance(t, int) for t in choice["token_ids"])
        return
    choice = json.loads(payload)["choices"][0]
    assert choice["finish_reason"] in FINISH_REASONS and all(isinstance(t, int) for t in choice["token_ids"])
    assert isinstance(choice["message"]["content"] if chat else choice["text"], str)


@SETTINGS
@given(prompt=st.one_of(valid_prompts, valid_prompts, prompts), body=fields,
       with_prompt=st.sampled_from([True] * 7 + [False]))
def test_completions_answer_every_body_with_2xx_or_4xx(server, prompt, body, with_prompt):
    served, _ = server
    body = {**body, "prompt": prompt} if with_prompt else body
    check_answer(*post(served.port, body, "/v1/completions"), chat=False)


@SETTINGS
@given(messages=messages, body=fields)
def test_chat_completions_answer_every_body_with_2xx_or_4xx(server, messages, body):
    served, _ = server
    check_answer(*post(served.port, {**body, "messages": messages}, "/v1/chat/completions"), chat=True)


@SETTINGS
@given(raw=st.one_of(st.binary(max_size=40), json_any.map(lambda v: json.dumps(v, allow_nan=True).encode())))
def test_any_bytes_as_a_body_get_an_answer(server, raw):
    served, _ = server
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    try:
        connection.request("POST", "/v1/completions", raw, {"Content-Type": "application/json"})
        response = connection.getresponse()
        check_answer(response.status, response.getheader("Content-Type", ""), response.read(), chat=False)
    finally:
        connection.close()


def test_the_server_serves_after_the_fuzzing(server):
    """Runs after the fuzzers in this module (pytest keeps file order)."""
    served, session = server
    assert json.loads(get(served.url, "/health")[1])["status"] == "ok"
    reply = complete(served.url, {"prompt": "def f(", "max_tokens": 6}, timeout=60)
    assert reply.text == session.generate("def f(", max_new_tokens=6)
    assert served.engine.running == 0 and served.engine.error is None
