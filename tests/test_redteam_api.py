"""Red-team findings on the Python API: what a caller got wrong that Python's own TypeError (not an
InputError) answered, or that an error message described with a stale list of keywords. Each
bad call gets an InputError naming the problem, and the batcher goes on giving its tokens."""

from __future__ import annotations

import inspect

import pytest

from ortspec import validation
from ortspec.errors import ConfigurationError, InputError
from ortspec.session import Session
from ortspec.speculative.batcher import Batcher

PROMPT = [3, 14, 15]


@pytest.fixture(scope="module")
def want(session):
    return session.generate(PROMPT, max_new_tokens=6)


def served(batcher, want) -> None:
    """The batcher still serves a request, with the tokens generate gives."""
    rid = batcher.add_request(PROMPT, max_new_tokens=6)
    while batcher.pending:
        batcher.step()
    assert batcher.result(rid) == want


@pytest.mark.parametrize("call,match", [
    (lambda b: b.add_request(PROMPT, foo=1), r"add_request\(\) got an unknown keyword 'foo'; it takes prompt, "),
    (lambda b: b.add_request(PROMPT, stops=["x"]), r"unknown keyword 'stops'.* Did you mean 'stop'\?"),
    (lambda b: b.add_requests(PROMPT), r"requests\[0\]=3 must be a dict of add_request's keyword arguments"),
    (lambda b: b.add_requests([PROMPT]), r"requests\[0\]=\[3, 14, 15\] must be a dict"),
    (lambda b: b.add_requests([{}]), r"requests\[0\] has no 'prompt'"),
    (lambda b: b.add_requests([{"prompt": PROMPT}, {"prompt": PROMPT, "temprature": 1}]),
     r"requests\[1\]: add_request\(\) got an unknown keyword 'temprature'.* Did you mean 'temperature'\?"),
    (lambda b: b.add_requests({"prompt": PROMPT}), r"must be a list of dicts"),
    (lambda b: b.add_requests(5), r"requests=5 must be a list of dicts"),
])
def test_hostile_add_requests_are_input_errors(session, want, call, match):
    with session.batcher(max_batch_size=2) as batcher:
        with pytest.raises(InputError, match=match):
            call(batcher)
        assert batcher.rows[:2] == [None, None] and batcher.requests == {}  # nothing of it was placed
        served(batcher, want)


def test_add_requests_takes_any_iterable_of_dicts(session, want):
    with session.batcher(max_batch_size=2) as batcher:
        ids = batcher.add_requests(dict(prompt=PROMPT, max_new_tokens=6) for _ in range(2))
        while batcher.pending:
            batcher.step()
        assert [batcher.result(i) for i in ids] == [want, want]


def test_the_keyword_lists_in_messages_are_the_signatures():
    """The lists unknown-keyword errors name are each call's parameters (they went stale once:
    generate's message left out stop and min_p, and suggested stop_tokens for stop_strings)."""
    def parameters(function, leave_out=()):
        return {name for name, p in inspect.signature(function).parameters.items()
                if p.kind is not p.VAR_KEYWORD and name not in ("self", *leave_out)}

    assert set(validation.CALL_ARGUMENTS["generate"]) == parameters(Session.generate)
    assert set(validation.CALL_ARGUMENTS["batcher"]) == parameters(Session.batcher)
    assert set(validation.REQUEST_ARGUMENTS) == parameters(Batcher.add_request)
    assert set(validation.CALL_ARGUMENTS["Session"]) == parameters(Session.__init__)


@pytest.mark.parametrize("keyword,match", [
    ("k", r"Session\(\) got an unknown keyword 'k'; it takes model_dir, provider, .* Did you mean "
          r"'num_speculative_tokens'\?"),
    ("num_speculative_token", r"Did you mean 'num_speculative_tokens'\?"),
    ("temperature", r"temperature belongs to each call: session.generate\(prompt, temperature=...\)"),
    ("stop", r"stop belongs to each call"),
])
def test_an_unknown_session_option_is_a_configuration_error(tokenized_model, session, want, keyword, match):
    """Session(d, k=2) raised Python's TypeError, where generate's unknown keywords get an InputError."""
    with pytest.raises(ConfigurationError, match=match):
        Session(tokenized_model, **{keyword: 2})
    assert session.generate(PROMPT, max_new_tokens=6) == want


def test_unknown_keywords_point_at_the_right_argument(session):
    with pytest.raises(InputError, match=r"it takes .*min_p.*stop.* Did you mean 'stop'\?"):
        session.generate(PROMPT, max_new_tokens=2, stops=["x"])
    with pytest.raises(InputError, match=r"stop belongs to each request: batcher.add_request\(prompt, stop=...\)"):
        session.batcher(max_batch_size=2, stop=["x"])
    with pytest.raises(InputError, match=r"min_p belongs to each request"):
        session.batcher(max_batch_size=2, min_p=0.1)
