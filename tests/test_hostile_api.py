"""Hostile arguments to the Python API (issue 21): integers beyond int64, huge or non-finite
numbers, unpaired surrogates, a prefill that fails half way, two threads on one batcher, and
close() while a stream is half read. Each gets a typed error (or its correct answer), and the
Session and the batcher stay usable with their tokens unchanged."""

from __future__ import annotations

import shutil
import threading

import pytest

import ortspec
from ortspec.errors import ClosedError, ConcurrentUseError, InputError, ModelDirError


PROMPT = [3, 14, 15]


@pytest.fixture(scope="module")
def want(session):
    return session.generate(PROMPT, max_new_tokens=6)


@pytest.mark.parametrize("arguments,match", [
    (dict(temperature=0.5, top_k=2**63), r"top_k=9223372036854775808 exceeds 9223372036854775807"),
    (dict(temperature=0.5, seed=2**64), r"seed=18446744073709551616 exceeds"),
    (dict(max_new_tokens=10**30), r"max_new_tokens=1000000000000000000000000000000 exceeds"),
    (dict(temperature=10**400), r"temperature=1000.* must be a finite number >= 0.*finite as a float32"),
    (dict(temperature=1e39), r"finite as a float32"),
    (dict(temperature=float("nan")), r"temperature=nan must be a finite number"),
    (dict(temperature=0.5, top_p=1e-50), r"top_p=1e-50 rounds to 0 in float32"),
    (dict(temperature=0.5, top_k=10**5000), r"top_k=<an integer of 16610 bits> exceeds"),
    (dict(stop_tokens=range(10**30)), r"stop_tokens=range\(0, 1000.*\) holds 9+"),
])
def test_out_of_range_numbers_are_input_errors(session, want, arguments, match):
    with pytest.raises(InputError, match=match):
        session.generate(PROMPT, **{"max_new_tokens": 6, **arguments})
    with session.batcher(max_batch_size=2) as batcher:
        with pytest.raises(InputError, match=match):
            batcher.add_request(PROMPT, **{"max_new_tokens": 6, **arguments})
        assert batcher.rows[:2] == [None, None] and batcher.requests == {}  # nothing of it was placed
        rid = batcher.add_request(PROMPT, max_new_tokens=6)
        while batcher.pending:
            batcher.step()
        assert batcher.result(rid) == want
    assert session.generate(PROMPT, max_new_tokens=6) == want


def test_a_json_integer_temperature_is_a_number(session):
    """10**24 as an int (what JSON gives for 1000000000000000000000000): a very flat distribution."""
    assert len(session.generate(PROMPT, max_new_tokens=4, temperature=10**24, seed=1)) == 4
    assert session.generate(PROMPT, max_new_tokens=4, temperature=2, seed=1) == \
        session.generate(PROMPT, max_new_tokens=4, temperature=2.0, seed=1)


@pytest.mark.parametrize("prompt,match", [
    ("def \ud800(", r"the prompt holds an unpaired surrogate U\+D800 at character 4"),
    (["ok", "b\udfff"], r"prompt 1 holds an unpaired surrogate U\+DFFF at character 1"),
])
def test_unpaired_surrogates_are_refused_before_tokenizing(session, prompt, match):
    with pytest.raises(InputError, match=match):
        session.generate(prompt, max_new_tokens=2)
    with session.batcher(max_batch_size=1) as batcher, pytest.raises(InputError, match="unpaired surrogate"):
        batcher.add_request(prompt if isinstance(prompt, str) else prompt[1])
    assert session.generate("def \U0001F600(", max_new_tokens=2)  # a real pair is one character: fine


def test_add_request_is_atomic_when_the_prefill_fails(session, want, monkeypatch):
    """A planted failure inside the prefill: the error reaches the caller as it is, and nothing of
    the request remains (no id, no row), so the batcher's later requests decode as before."""
    with session.batcher(max_batch_size=2) as batcher:
        running = batcher.add_request(PROMPT, max_new_tokens=6)
        batcher.step()

        def broken(*requests):
            raise RuntimeError("planted prefill failure")

        admission = "admit" if hasattr(batcher.decoder, "admit") else "prefill"  # the one loop's name, or today's
        monkeypatch.setattr(batcher.decoder, admission, broken)
        with pytest.raises(RuntimeError, match="planted"):
            batcher.add_request([5, 6], max_new_tokens=4)
        assert batcher.rows[1] is None and list(batcher.requests) == [running]
        monkeypatch.undo()
        later = batcher.add_request(PROMPT, max_new_tokens=6)
        while batcher.pending:
            batcher.step()
        assert batcher.result(running) == batcher.result(later) == want


def test_a_batcher_called_from_two_threads_at_once_is_a_typed_error(session, want, monkeypatch):
    with session.batcher(max_batch_size=2) as batcher:
        rid = batcher.add_request(PROMPT, max_new_tokens=6)
        inside, release = threading.Event(), threading.Event()
        step = batcher.decoder.step

        def held_step(*requests):
            inside.set()
            release.wait(30)
            return step(*requests)

        monkeypatch.setattr(batcher.decoder, "step", held_step)
        first = threading.Thread(target=batcher.step)
        first.start()
        assert inside.wait(30)
        for call in (batcher.step, lambda: batcher.add_request(PROMPT), lambda: batcher.cancel(rid)):
            with pytest.raises(ConcurrentUseError, match="in a call from another thread"):
                call()
        release.set()
        first.join()
        monkeypatch.undo()
        while batcher.pending:
            batcher.step()
        assert batcher.result(rid) == want


def test_cancel_after_close_is_a_closed_error(session):
    batcher = session.batcher(max_batch_size=1)
    rid = batcher.add_request(PROMPT, max_new_tokens=4)
    batcher.close()
    with pytest.raises(ClosedError):
        batcher.cancel(rid)
    assert batcher.result(rid) and batcher.finish_reason(rid) is None  # still answers


def test_close_while_a_stream_is_half_read_waits_one_step_at_most(tokenized_model):
    session = ortspec.Session(tokenized_model, num_speculative_tokens=2)
    stream = session.generate(PROMPT, max_new_tokens=30, stream=True)
    first = [next(stream), next(stream)]
    closing = threading.Thread(target=session.close, daemon=True)
    closing.start()
    closing.join(30)
    assert not closing.is_alive(), "close() waited for the half-read stream"
    assert session.closed and len(first) == 2
    with pytest.raises(ClosedError):
        next(stream)
    stream.close()


def test_a_stream_closed_early_gives_its_engine_back(session):
    stream = session.generate(PROMPT, max_new_tokens=30, stream=True)
    next(stream)
    stream.close()
    assert all(sizes["leased"] == 0 for sizes in session.stats["engines"].values())


def test_a_junk_tokenizer_json_is_a_model_dir_error(tokenized_model, tmp_path):
    model = shutil.copytree(tokenized_model, tmp_path / "model")
    tokenizer = model / "tokenizer.json"
    size = tokenizer.stat().st_size
    tokenizer.write_bytes(b"{" + b" " * (size - 2) + b"}")  # same size: the load's size check passes
    with ortspec.Session(model) as session:
        with pytest.raises(ModelDirError, match="does not load as a tokenizer"):
            session.generate("def f(", max_new_tokens=2)
        assert session.generate(PROMPT, max_new_tokens=2)  # token ids still work
