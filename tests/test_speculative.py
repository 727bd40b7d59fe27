"""Speculative decoding is exact: same tokens as greedy, and after every commit the same
states (bitwise, CPU fp32) as a plain one-token-at-a-time decode over the same tokens."""

from __future__ import annotations

import numpy as np
import pytest

import ortspec
from ortspec.runtime.graphs import GraphSet
from ortspec.spec.decoder import Decoder, accept_lengths
from ortspec.spec.drafts import MTPDrafts, ScriptedDrafts
from ortspec.spec.requests import Batch, Request
from ortspec.spec.stats import Stats

PROMPTS = [[5, 17, 99, 3, 250, 7, 11], [42], [8, 8, 8, 300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]


def test_accept_lengths_rule():
    drafts = np.array([[1, 2, 3], [1, 2, 3], [9, 2, 3], [1, 2, 4]])
    targets = np.array([[1, 2, 3, 7], [1, 5, 3, 7], [1, 2, 3, 7], [1, 2, 3, 7]])
    assert accept_lengths(drafts, targets).tolist() == [3, 1, 0, 2]


@pytest.mark.parametrize("config", ["base", "attn_first", "mixed"])
def test_speculative_tokens_equal_greedy(models, config):
    out = models.converted(config)
    greedy = ortspec.Session(out).generate(PROMPTS, max_new_tokens=40)
    for commit in ("select", "readvance"):
        for k in (1, 2, 3, 4):
            session = ortspec.Session(out, num_speculative_tokens=k, commit=commit)
            assert session.generate(PROMPTS, max_new_tokens=40) == greedy, (commit, k)
            assert session.generate(PROMPTS[0], max_new_tokens=40) == greedy[0], (commit, k)
            assert session.stats["position_mismatches"] == 0


# -- state equality after every commit ---------------------------------------------------------

def _requests(prompts, max_new_tokens):
    return [Request(row=i, prompt=list(p), max_new_tokens=max_new_tokens) for i, p in enumerate(prompts)]


def _record(decoder: Decoder, requests, table):
    for req in requests:
        T = req.processed
        table[(req.row, T)] = (
            req.pending,
            req.next_draft,
            req.draft_hidden.copy(),
            decoder.target.states.row_state(req.row, T),
            decoder.mtp.states.row_state(req.row, T),
        )


def plain_decode_states(graphs, prompts, max_new_tokens, k):
    """Greedy one token at a time (with the MTP head fed every token), states after each token."""
    decoder = Decoder(graphs, len(prompts), k, "select", Stats())
    requests, table = _requests(prompts, max_new_tokens), {}
    for req in requests:
        decoder.prefill(req)
    _record(decoder, requests, table)
    while not all(r.done for r in requests):
        batch = Batch([r for r in requests if not r.done])
        decoder.greedy_step(batch)
        _record(decoder, batch.requests, table)
    return {r.row: r.tokens for r in requests}, table


def assert_same_state(got, want, where):
    pending, draft, hidden, target, mtp = got
    w_pending, w_draft, w_hidden, w_target, w_mtp = want
    assert (pending, draft) == (w_pending, w_draft), where
    assert np.array_equal(hidden, w_hidden), where
    for name in w_target:
        assert np.array_equal(target[name], w_target[name]), f"{where}: target state {name} differs"
    for name in w_mtp:
        assert np.array_equal(mtp[name], w_mtp[name]), f"{where}: MTP state {name} differs"


def run_scripted(graphs, prompts, oracle, max_new_tokens, k, commit, p, seed, reference):
    stats, checked = Stats(), []

    def on_commit(decoder, batch):
        for req in batch.requests:
            key = (req.row, req.processed)
            assert key in reference, f"no plain-decode state at row {req.row} length {req.processed}"
            got = {}
            _record(decoder, [req], got)
            assert_same_state(got[key], reference[key], f"{commit} k={k} row {req.row} T={req.processed}")
            checked.append(key)

    decoder = Decoder(graphs, len(prompts), k, commit, stats,
                      make_drafts=lambda mtp: ScriptedDrafts(MTPDrafts(mtp), oracle, graphs.manifest.spec.vocab_size,
                                                             p=p, seed=seed),
                      on_commit=on_commit)
    requests = _requests(prompts, max_new_tokens)
    outputs = decoder.generate(requests)
    for req, out in zip(requests, outputs):
        assert out == oracle[req.row][len(req.prompt):len(req.prompt) + max_new_tokens]
    return stats, checked


@pytest.mark.parametrize("commit", ["select", "readvance"])
def test_states_equal_plain_decode_after_every_commit(models, commit):
    """Property test: scripted drafts drive every accept length 0..k; >= 1,000 steps per strategy."""
    graphs = GraphSet(ortspec.Session(models.converted("base")).manifest)
    prompts = PROMPTS
    new_tokens = 150
    total_steps, histograms = 0, {}
    for k in (2, 3, 4):
        oracle, reference = plain_decode_states(graphs, prompts, new_tokens + k + 1, k)
        for p, seed in ((None, k), (0.8, 10 + k)):
            stats, checked = run_scripted(graphs, prompts, oracle, new_tokens, k, commit, p, seed, reference)
            assert stats.position_mismatches == 0
            total_steps += stats.speculative_steps
            hist = histograms.setdefault(k, [0] * (k + 1))
            for a, n in enumerate(stats.accept_histogram):
                hist[a] += n
    assert total_steps >= 1000, total_steps
    for k, hist in histograms.items():
        assert min(hist) >= 15, f"k={k}: some accept length was rarely exercised: {hist}"


def test_readvance_skips_full_acceptance(models):
    graphs = GraphSet(ortspec.Session(models.converted("base")).manifest)
    oracle, reference = plain_decode_states(graphs, PROMPTS, 40, 3)
    stats, _ = run_scripted(graphs, PROMPTS, oracle, 30, 3, "readvance", 1.0, 0, reference)
    assert stats.accept_histogram[:3] == [0, 0, 0] and stats.accept_histogram[3] > 0
    assert stats.readvance_tokens == 0
    stats, _ = run_scripted(graphs, PROMPTS, oracle, 30, 3, "readvance", 0.0, 0, reference)
    assert stats.readvance_tokens == stats.speculative_steps  # a=0: exactly the pending token re-run


def test_position_mismatch_is_counted(models):
    """Plant a wrong recorded accept length; the positions check must notice and count it."""
    graphs = GraphSet(ortspec.Session(models.converted("base")).manifest)

    def corrupt(decoder, batch):
        batch.requests[0].last_accepted += 1

    stats = Stats()
    decoder = Decoder(graphs, 2, 2, "select", stats, on_commit=corrupt)
    decoder.generate(_requests(PROMPTS[:2], 10))
    assert stats.position_mismatches > 0


def test_stats_are_reported(models):
    session = ortspec.Session(models.converted("base"), num_speculative_tokens=2)
    session.generate(PROMPTS, max_new_tokens=12)
    st = session.stats
    assert st["requests"] == 3 and st["generated_tokens"] == 36
    assert st["drafted"] == 2 * sum(st["accept_histogram"])
    assert len(st["accept_histogram"]) == 3
    assert st["mean_tokens_per_step"] >= 1.0
    assert all(st["seconds"][phase] > 0 for phase in ("prefill", "propose", "verify", "commit"))


def test_option_errors(models, tmp_path):
    out = models.converted("base")
    with pytest.raises(ortspec.ConfigurationError, match="exceeds K=4"):
        ortspec.Session(out, num_speculative_tokens=5)
    with pytest.raises(ortspec.ConfigurationError, match="commit='fast' is unknown"):
        ortspec.Session(out, num_speculative_tokens=2, commit="fast")
    from tools.make_tiny_checkpoint import make_checkpoint

    make_checkpoint(tmp_path / "ck", seed=4, mtp=False)
    ortspec.convert(tmp_path / "ck", tmp_path / "out", num_speculative_tokens=2, max_length=64, progress=False)
    with pytest.raises(ortspec.ConfigurationError, match="without mtp"):
        ortspec.Session(tmp_path / "out", num_speculative_tokens=1)
    assert len(ortspec.Session(tmp_path / "out").generate([1, 2, 3], max_new_tokens=5)) == 5
