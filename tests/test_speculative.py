"""Speculative decoding is exact: same tokens as greedy, and after every commit the same
states (bitwise, CPU fp32) as a plain one-token-at-a-time decode over the same tokens."""

from __future__ import annotations

import numpy as np
import pytest

import ortspec
from ortspec.runtime.graphs import GraphSet
from ortspec.speculative.decoder import Decoder
from ortspec.speculative.sampling import accept_lengths
from ortspec.speculative.drafts import MTPDrafts, ScriptedDrafts
from ortspec.speculative.exactness import ExactnessError, make_requests, check_speculative, plain_decode_states
from ortspec.speculative.stats import Stats

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

@pytest.mark.parametrize("commit", ["select", "readvance"])
def test_states_equal_plain_decode_after_every_commit(models, commit):
    """Property test: scripted drafts drive every accept length 0..k, batch of 3, k = 2..4;
    after every commit all states equal the plain decode's bitwise. >= 1,000 steps per strategy.
    select runs every step as one graph (verify_mtp_k{k}); test_fused_verify.py checks its
    steps in two Runs too."""
    graphs = GraphSet(ortspec.Session(models.converted("base")).manifest)
    new_tokens, total_steps = 150, 0
    for k in (2, 3, 4):
        reference = plain_decode_states(graphs, PROMPTS, new_tokens + k + 1, k)
        histogram = np.zeros(k + 1, int)
        for p, seed in ((None, k), (0.8, 10 + k)):
            stats = check_speculative(graphs, PROMPTS, new_tokens, k, commit, p=p, seed=seed, reference=reference)
            assert stats.fused_verify_steps == (stats.speculative_steps if commit == "select" else 0)
            total_steps += stats.speculative_row_steps
            histogram += stats.accept_histogram
        assert histogram.min() >= 15, f"k={k}: some accept length was rarely exercised: {histogram}"
    assert total_steps >= 1000, total_steps


def test_a_planted_state_bug_is_caught(models, monkeypatch):
    """The check is not vacuous: commit one slot too far in the select path and it must fail."""
    from ortspec.runtime.states import StateSet

    graphs = GraphSet(ortspec.Session(models.converted("base")).manifest)
    original = StateSet.select
    monkeypatch.setattr(StateSet, "select", lambda self, out, rows, pos, acc, counts=None: original(
        self, out, rows, pos, np.minimum(np.asarray(acc) + 1, pos.shape[1] - 1)))
    with pytest.raises(ExactnessError, match="differs from the plain decode"):
        check_speculative(graphs, PROMPTS, 20, 2, "select", p=0.5)


def test_fixed_rows_batching_is_exact(models):
    """The all-rows batching CUDA uses (finished rows keep running, frozen) on the CPU, with
    requests of different lengths that finish at different steps."""
    graphs = GraphSet(ortspec.Session(models.converted("mixed")).manifest)
    for commit in ("select", "readvance"):
        for k in (2, 4):
            stats = check_speculative(graphs, PROMPTS, 60, k, commit, p=0.7, seed=k, fixed_rows=True)
            assert stats.speculative_row_steps > 40


def test_a_row_finished_at_max_length_keeps_running_inside_the_buffers(tmp_path, models):
    """Fixed rows (CUDA's batching): a request whose prompt + max_new_tokens is max_length,
    finished by a fully accepted verify at T = L-1-k, stands at T = L; its row runs on while
    another request decodes, and must not write at position L (it crashed: index out of bounds)."""
    out = ortspec.convert(models.checkpoint("base"), tmp_path / "short", num_speculative_tokens=4, max_length=32,
                          progress=False)
    graphs = GraphSet(ortspec.Session(out).manifest)
    prompts, lengths = [list(range(1, 23)), [5, 6]], (10, 25)  # 22 + 10 = 32; steps at T = 22, 27 -> 32
    greedy = make_requests(prompts, 0)
    for req, n in zip(greedy, (11, 25)):
        req.max_new_tokens = n
    Decoder(graphs, 2, 0, "select", Stats()).generate(greedy)
    truth = {r.row: r.tokens + [0] * 4 for r in greedy}
    requests = make_requests(prompts, 0)
    for req, n in zip(requests, lengths):
        req.max_new_tokens = n
    decoder = Decoder(graphs, 2, 4, "select", Stats(), fixed_rows=True, make_drafts=lambda mtp: ScriptedDrafts(
        MTPDrafts(mtp), lambda r: truth[r.row], graphs.manifest.spec.vocab_size, p=1.0))
    outputs = decoder.generate(requests)
    assert requests[0].processed == 32 and outputs == [r.tokens[len(r.prompt):][:n] for r, n in zip(greedy, lengths)]


def test_readvance_skips_full_acceptance(models):
    graphs = GraphSet(ortspec.Session(models.converted("base")).manifest)
    reference = plain_decode_states(graphs, PROMPTS, 40, 3)
    stats = check_speculative(graphs, PROMPTS, 30, 3, "readvance", p=1.0, reference=reference)
    assert stats.accept_histogram[:3] == [0, 0, 0] and stats.accept_histogram[3] > 0
    assert stats.readvance_forwards == 0
    stats = check_speculative(graphs, PROMPTS, 30, 3, "readvance", p=0.0, reference=reference)
    assert stats.readvance_forwards == stats.speculative_steps  # a=0 in every row: only the pending token re-run


def test_position_mismatch_is_counted(models):
    """Plant a wrong recorded accept length; the positions check must notice and count it."""
    graphs = GraphSet(ortspec.Session(models.converted("base")).manifest)

    def corrupt(decoder, batch):
        batch.requests[0].last_accepted += 1

    stats = Stats()
    decoder = Decoder(graphs, 2, 2, "select", stats, on_commit=corrupt)
    decoder.generate(make_requests(PROMPTS[:2], 10))
    assert stats.position_mismatches > 0


def test_stats_are_reported(models):
    session = ortspec.Session(models.converted("base"), num_speculative_tokens=2)
    session.generate(PROMPTS, max_new_tokens=12)
    st = session.stats
    assert st["requests"] == 3 and st["generated_tokens"] == 36
    assert st["drafted"] == 2 * sum(st["accept_histogram"])
    assert len(st["accept_histogram"]) == 3
    assert st["mean_tokens_per_step"] >= 1.0
    assert all(st["seconds"][phase] > 0 for phase in ("prefill", "propose", "verify"))
    session.reset_stats()  # a fused step enqueues its commit with its Run (verify); two Runs time it apart
    session.generate(PROMPTS, max_new_tokens=12, fused_verify=False)
    assert all(session.stats["seconds"][phase] > 0 for phase in ("prefill", "propose", "verify", "commit"))


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
