"""Stop strings (``ortspec.stop_strings``, ``generate(stop=...)``, ``add_request(stop=...)``) and
log-probabilities (``add_request(logprobs=N)``) in the Python API.

A stop string is matched on the decoded text across token boundaries: the text ends before it,
the tokens at the one that completed it, whatever k (a step's later tokens are past the stop),
and the request's row is free at once. Text a stream hands out is never past a stop. A request
that asks for logprobs runs on the host kinds of step, with the tokens greedy output has, and
the values of a log-softmax of a forced decode; greedy requests without stay on the device kinds.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ortspec
from ortspec.errors import InputError
from ortspec.speculative import step_kinds
from ortspec.speculative.logprobs import log_softmax
from ortspec.speculative.requests import Request
from ortspec.speculative.sampling import SamplingParams
from tests.forced import forced_logits
from ortspec.stop_strings import StopStrings

PROMPT = "def main("


@pytest.fixture(scope="module")
def tokenizer(session):
    return session.tokenizer


def generated(session, n: int = 30) -> list[int]:
    return session.generate(session.tokenizer.encode(PROMPT).ids, max_new_tokens=n, stop_tokens=[])


def feed(text: StopStrings, ids: list[int], cuts: list[int]) -> tuple[int | None, list[str]]:
    """Feeds ids in the chunks that cuts make; (the add that stopped: tokens taken in all, the pieces taken)."""
    pieces, taken, start = [], None, 0
    for end in sorted(set(cuts) | {len(ids)}):
        got = text.add(ids[start:end])
        pieces.append(text.take())
        if got is not None:
            taken = start + got
            break
        start = end
    else:
        text.finish()
        pieces.append(text.take())
    return taken, pieces


@settings(max_examples=60, deadline=None, database=None)
@given(data=st.data())
def test_the_text_ends_before_the_first_stop_whatever_the_chunks(session, tokenizer, data):
    ids = data.draw(st.lists(st.integers(3, tokenizer.get_vocab_size() - 1), min_size=1, max_size=14))
    full = tokenizer.decode(ids)
    at = data.draw(st.integers(0, max(len(full) - 1, 0)))
    stops = [full[at: at + data.draw(st.integers(1, 4))] or "x", data.draw(st.text(min_size=1, max_size=3))]
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=4))
    text = StopStrings(tokenizer, stops)
    taken, pieces = feed(text, ids, cuts)
    found = [i for i in (full.find(s) for s in stops) if i >= 0]
    assert text.text == "".join(pieces) == (full[: min(found)] if found else full)  # nothing handed out past it
    if taken is not None:  # the token that completed it: the text up to it holds the stop, the text before not
        assert any(s in tokenizer.decode(ids[:taken]) for s in stops)
        before = StopStrings(tokenizer)
        before.add(ids[: taken - 1])  # (text ending in an unfinished character is held back until it completes)
        assert not any(s in before.text for s in stops)


def test_a_stream_holds_back_what_may_start_a_stop(tokenizer):
    ids = tokenizer.encode("abcdef").ids
    text = StopStrings(tokenizer, ["cdx", "e"])
    pieces = []
    for t in ids:
        if text.add([t]) is not None:
            break
        pieces.append(text.take())
    assert "".join(pieces) + text.take() == "abcd" and text.stopped
    held = StopStrings(tokenizer, ["cdx"])
    held.add(tokenizer.encode("abcd").ids)
    assert held.take() == "ab"  # "cd" may begin "cdx"
    held.finish()
    assert held.take() == "cd" and not held.stopped


def test_generate_stops_at_the_token_that_completes_a_stop_string_for_every_k(tokenized_model, session, tokenizer):
    ids = generated(session)
    full = tokenizer.decode(ids)
    pieces = [tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    stop = full[len(pieces[3]) - 1: len(pieces[3]) + 1]  # the end of token 3 and the start of token 4
    count = next(i for i, p in enumerate(pieces) if stop in p)
    prompt = tokenizer.encode(PROMPT).ids
    for k in (0, 1, 3):
        with ortspec.Session(tokenized_model, num_speculative_tokens=k) as each:
            assert each.generate(prompt, max_new_tokens=30, stop_tokens=[], stop=stop) == ids[:count]
            assert each.generate(PROMPT, max_new_tokens=30, stop_tokens=[], stop=[stop]) == full[: full.index(stop)]
            assert "".join(each.generate(PROMPT, max_new_tokens=30, stop_tokens=[], stop=stop, stream=True)) == \
                full[: full.index(stop)]
    assert session.generate([prompt, prompt[:2]], max_new_tokens=30, stop_tokens=[], stop=stop)[0] == ids[:count]


def test_a_batcher_frees_the_row_at_a_stop_string(session, tokenizer):
    ids = generated(session, 20)
    stop = tokenizer.decode(ids[:6])[-2:]
    count = next(i for i in range(1, 21) if stop in tokenizer.decode(ids[:i]))
    with session.batcher(max_batch_size=2) as batcher:
        rid = batcher.add_request(PROMPT, max_new_tokens=20, stop_tokens=[], stop=[stop])
        other = batcher.add_request(PROMPT, max_new_tokens=20, stop_tokens=[])
        while rid in batcher.running:
            batcher.step()
        assert batcher.finish_reason(rid) == "stop" and batcher.result(rid) == ids[:count]
        assert other in batcher.running and len(batcher.result(other)) < 20  # it left while the other ran on
        again = batcher.add_request(PROMPT, max_new_tokens=3)  # into the freed row
        while batcher.pending:
            batcher.step()
        assert batcher.result(other) == ids and batcher.result(again) == ids[:3]


@pytest.mark.parametrize("stop,match", [(5, r"stop=5 must be a string or a list of non-empty strings"),
                                        (["a", ""], r"list of non-empty strings"),
                                        ("\ud800", r"unpaired surrogate")])
def test_bad_stop_strings_are_refused(session, stop, match):
    with pytest.raises(InputError, match=match):
        session.generate(PROMPT, max_new_tokens=2, stop=stop)


def test_stop_strings_need_a_tokenizer(models):
    with ortspec.Session(models.converted("base")) as plain:
        with pytest.raises(InputError, match=r"has no tokenizer.json, so stop strings cannot be matched"):
            plain.generate([1, 2, 3], max_new_tokens=2, stop="x")


# -- logprobs --------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 2])
def test_logprobs_requests_keep_greedy_tokens_and_score_them_as_a_forced_decode(tokenized_model, k):
    with ortspec.Session(tokenized_model, num_speculative_tokens=k) as each:
        prompt = each.tokenizer.encode(PROMPT).ids
        want = each.generate(prompt, max_new_tokens=12, stop_tokens=[])
        with each.batcher(max_batch_size=3) as batcher:
            asks = batcher.add_request(prompt, max_new_tokens=12, stop_tokens=[], logprobs=4)
            plain = batcher.add_request(prompt, max_new_tokens=12, stop_tokens=[])
            while batcher.pending:
                batcher.step()
            assert batcher.result(asks) == batcher.result(plain) == want
            entries = batcher.logprobs(asks)
            with pytest.raises(InputError, match="was added without logprobs"):
                batcher.logprobs(plain)
        forced = log_softmax(forced_logits(each.graphs, prompt, want))  # [12, V]
        assert [e.token for e in entries] == want
        np.testing.assert_allclose([e.logprob for e in entries], forced[np.arange(12), want], atol=1e-4)
        for entry, row in zip(entries, forced):
            assert [t for t, _ in entry.top] == list(np.argsort(-row, kind="stable")[:4])


def test_steps_with_a_request_that_asks_for_logprobs_run_on_the_host():
    kinds = step_kinds.StepKinds(None, None, None, None, None, None, device=True, fused_ks=frozenset({2}))
    greedy, asks = Request(0, [1], 4), Request(1, [1], 4, logprobs=0)
    sampled = Request(2, [1], 4, sampling=SamplingParams(temperature=1.0))
    assert kinds.choose([greedy], 0, 0) is step_kinds.DecodeSteps
    assert kinds.choose([greedy], 2, 2) is step_kinds.FusedSteps
    for other in (asks, sampled):
        assert kinds.choose([greedy, other], 0, 0) is step_kinds.HostDecodeSteps
        assert kinds.choose([greedy, other], 2, 2) is step_kinds.TwoRunSteps
    asks.done = True  # a finished row asks nothing
    assert kinds.choose([greedy, asks], 2, 2) is step_kinds.FusedSteps
    kinds.sampled_ks = frozenset({0, 2})  # a model with the graphs that sample on the device
    assert kinds.choose([greedy, sampled], 0, 0) is step_kinds.DecodeSteps
    assert kinds.choose([greedy, sampled], 2, 2) is step_kinds.FusedSteps
    assert kinds.choose([greedy, sampled], 2, 1) is step_kinds.TwoRunSteps  # the next k differs: two Runs


def test_bad_logprobs_are_refused(session):
    with session.batcher(max_batch_size=1) as batcher:
        for value in (-1, 21, 1.5, True):
            with pytest.raises(InputError, match=r"logprobs=.* must be None or an integer in \[0, 20\]"):
                batcher.add_request(PROMPT, max_new_tokens=2, logprobs=value)
