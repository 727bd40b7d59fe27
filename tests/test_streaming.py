"""Streaming: generate(..., stream=True), the incremental detokenizer, and the batcher's step()
reporting every token once (each request's first included), cancel and finish reasons."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

import ortspec
from ortspec.detokenizer import IncrementalDetokenizer

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 17, 99, 3, 250, 7, 11], [42], [8, 8, 8, 300, 1, 2]]
TEXTS = ["naïve café: 東京 → 🚀🎉 déjà vu", "def f(x):\n    return x ** 2  # ½ · π ≈ 1.57 ✓", "emoji 👩‍👩‍👧 and 𝔘𝔫𝔦"]


@pytest.mark.parametrize("k", [0, 2])
def test_streamed_ids_equal_the_whole_output(models, k):
    session = ortspec.Session(models.converted("base"), num_speculative_tokens=k)
    for prompt in PROMPTS:
        assert list(session.generate(prompt, max_new_tokens=20, stream=True)) == session.generate(prompt, max_new_tokens=20)
    sampled = dict(max_new_tokens=20, temperature=1.2, seed=4)
    assert list(session.generate(PROMPTS[0], stream=True, **sampled)) == session.generate(PROMPTS[0], **sampled)
    assert list(session.generate(PROMPTS[0], max_new_tokens=0, stream=True)) == []


def test_a_stream_yields_as_each_step_commits(models):
    """The first piece arrives after the prefill alone, and pieces are yielded step by step."""
    session = ortspec.Session(models.converted("base"), num_speculative_tokens=2)
    stream = session.generate(PROMPTS[0], max_new_tokens=30, stream=True)
    next(stream)
    assert session.stats["requests"] == 0  # counters are recorded when the call ends: it has not
    assert session.stats["engines"][1]["leased"] == 1
    stream.close()  # a client that stops reading gives the state buffers back
    assert session.stats["engines"][1]["leased"] == 0 and session.stats["requests"] == 1


def test_an_unfinished_stream_holds_its_engine(models):
    session = ortspec.Session(models.converted("base"), max_engines_per_batch_size=1)
    stream = session.generate(PROMPTS[0], max_new_tokens=10, stream=True)
    next(stream)
    with pytest.raises(ortspec.EnginesHeldError):
        session.generate(PROMPTS[1], max_new_tokens=4)
    del stream  # dropped unread: garbage collection closes it
    assert len(session.generate(PROMPTS[1], max_new_tokens=4)) == 4


def test_streamed_text_equals_the_whole_text(tokenized_model):
    session = ortspec.Session(tokenized_model, num_speculative_tokens=2)
    for text in ["def main(", "the cache", "é"]:
        pieces = list(session.generate(text, max_new_tokens=30, stream=True))
        assert "".join(pieces) == session.generate(text, max_new_tokens=30)
        assert all(pieces)


def test_a_batch_cannot_be_streamed(models):
    session = ortspec.Session(models.converted("base"))
    with pytest.raises(ortspec.InputError, match=r"takes one prompt, got a batch of 3; for many streams use "
                                                 r"session.batcher\(\)"):
        session.generate(PROMPTS, stream=True)


@pytest.fixture(scope="module")
def python_tokenizer():
    """The byte-level BPE of the shipped trained model (multi-byte characters span tokens)."""
    return Tokenizer.from_file(str(ROOT / "models" / "qwen35-python-20m" / "tokenizer.json"))


def pieces_of(tokenizer, ids, chunk):
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.add(ids[i: i + chunk]) for i in range(0, len(ids), chunk)]
    return pieces + [detokenizer.finish()]


@pytest.mark.parametrize("chunk", [1, 3])
def test_detokenizer_never_splits_a_character(python_tokenizer, chunk):
    for text in TEXTS:
        ids = python_tokenizer.encode(text).ids
        split = [python_tokenizer.decode([t]) for t in ids]
        assert any("\ufffd" in piece for piece in split)  # these texts do split characters across tokens
        pieces = pieces_of(python_tokenizer, ids, chunk)
        assert "".join(pieces) == python_tokenizer.decode(ids) == text
        assert not any("\ufffd" in piece for piece in pieces)


def test_detokenizer_joins_to_the_whole_decode_on_any_ids(python_tokenizer):
    """Random ids (invalid UTF-8 included: the held-back U+FFFD comes out at finish())."""
    rng = np.random.default_rng(0)
    vocab = python_tokenizer.get_vocab_size()
    for _ in range(50):
        ids = rng.integers(0, vocab, rng.integers(1, 40)).tolist()
        assert "".join(pieces_of(python_tokenizer, ids, int(rng.integers(1, 4)))) == python_tokenizer.decode(ids)


def test_batcher_step_reports_every_token_once(models):
    """What a client collects from step() is result(), the first token (made when the request was
    added) included, also for a request that finished at its prefill."""
    session = ortspec.Session(models.converted("base"), num_speculative_tokens=2)
    with session.batcher(max_batch_size=3) as batcher:
        collected = {}
        a = batcher.add_request(PROMPTS[0], max_new_tokens=12)
        first = batcher.step()
        assert first[a][0] == batcher.result(a)[0]
        collected[a] = first[a]
        b = batcher.add_request(PROMPTS[1], max_new_tokens=1)  # done at its prefill
        c = batcher.add_request(PROMPTS[2], max_new_tokens=9, temperature=1.0, seed=2)
        while batcher.pending:
            for rid, tokens in batcher.step().items():
                collected.setdefault(rid, []).extend(tokens)
        assert collected == {rid: batcher.result(rid) for rid in (a, b, c)}
        assert [batcher.finish_reason(r) for r in (a, b, c)] == ["length"] * 3
        assert batcher.step() == {}


def test_cancel_frees_the_row_and_ends_the_reports(models):
    session = ortspec.Session(models.converted("base"), num_speculative_tokens=2)
    with session.batcher(max_batch_size=1) as batcher:
        a = batcher.add_request(PROMPTS[0], max_new_tokens=40)
        batcher.step()
        assert batcher.finish_reason(a) is None
        batcher.cancel(a)
        assert batcher.finish_reason(a) == "cancelled" and batcher.pending == [] and batcher.running == []
        kept = batcher.result(a)
        b = batcher.add_request(PROMPTS[1], max_new_tokens=5)  # the only row is free again
        while batcher.pending:
            assert a not in batcher.step()
        assert batcher.result(a) == kept and batcher.result(b) == session.generate(PROMPTS[1], max_new_tokens=5)
        stop = batcher.result(b)[0]
        c = batcher.add_request(PROMPTS[1], max_new_tokens=5, stop_tokens=[stop])
        assert batcher.step() == {c: [stop]} and batcher.finish_reason(c) == "stop"
