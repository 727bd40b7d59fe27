"""Speculative sampling keeps the target's distribution: a two-sample chi-square test.

20,000 continuations of one prompt per configuration, sampled (temperature 4, top-k 8, top-p
0.95) on a tiny model whose head's drafts agree with the target about half of the time (so
steps accept every length 0..k, and q differs from p). The joint distribution of the first 5
tokens (the prefill's and four more: with k = 3 one step can emit all four) under k = 1, 2, 3
must agree with k = 0's, with the acceptance on the device (verify_mtp_sample_k{k}) and on the
host (two-Run steps). Each comparison rejects at p < 1e-3 / 4, so the chance that the correct
sampler fails this file is at most 1e-3 (Bonferroni over the four); the seeds are
fixed, so a run is reproducible. Accepting drafts without the ratio p/q (the planted bug) is
rejected at p < 1e-3 / 4 too (measured: p ~ 0, chi-square ~ 20,000 on ~130 cells).

All rows share the prompt, so each configuration is one batch of 20,000 rows: a grouped
prefill and a few steps (~5 s each on 2 cores). ORTSPEC_TEST_PROVIDER=cuda runs the same test on
a GPU (the head's draws then come from the CUDA graph of mtp_sample_k{k}).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import ortspec
from ortspec.speculative import sampling
from tools.gpu_suite.sample_dist import homogeneity_p_value
from tools.make_tiny_checkpoint import make_checkpoint

SAMPLES = 20_000
NEW_TOKENS = 5
ALPHA = 1e-3 / 4  # four comparisons against k = 0: a false alarm in this file has probability <= 1e-3
PROMPT = [3, 5]
SAMPLING = dict(temperature=4.0, top_k=8, top_p=0.95)
PROVIDER = os.environ.get("ORTSPEC_TEST_PROVIDER", "cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Vocabulary 32, hidden 32, two layers: a forward of 20,000 rows costs milliseconds."""
    root = tmp_path_factory.mktemp("spread")
    make_checkpoint(root / "ck", seed=5, vocab_size=32, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
                    linear_key_head_dim=16, linear_value_head_dim=16,
                    layer_types=("linear_attention", "full_attention"), draft_agreement=10.0)
    return ortspec.convert(root / "ck", root / "out", num_speculative_tokens=3, max_length=16, progress=False)


def first_tokens(model, k: int, seed: int, **options) -> tuple[list[list[int]], dict]:
    """options: generate's (fused_verify=False: every step in two Runs, the acceptance on the host;
    by default a speculative step accepts on the device, verify_mtp_sample_k{k})."""
    session = ortspec.Session(model, num_speculative_tokens=k, provider=PROVIDER)
    tokens = session.generate([PROMPT] * SAMPLES, max_new_tokens=NEW_TOKENS, stop_tokens=[], seed=seed, **SAMPLING,
                              **options)
    return tokens, session.stats


@pytest.fixture(scope="module")
def plain(model):
    """The reference: plain sampling, one token per forward (k = 0)."""
    return first_tokens(model, 0, seed=100)[0]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculative_sampling_keeps_the_joint_distribution(model, plain, k):
    tokens, stats = first_tokens(model, k, seed=100 + k)
    assert all(stats["accept_histogram"]), stats["accept_histogram"]  # every accept length 0..k occurred
    assert homogeneity_p_value(plain, tokens) > ALPHA


def test_the_host_acceptance_keeps_it_too(model, plain):
    """Two-Run steps (readvance, exact mode, stages, a change of k) accept on the host."""
    tokens, stats = first_tokens(model, 3, seed=300, fused_verify=False)
    assert stats["fused_verify_steps"] == 0 and all(stats["accept_histogram"]), stats
    assert homogeneity_p_value(plain, tokens) > ALPHA


def test_accepting_drafts_without_the_ratio_is_caught(model, plain, monkeypatch):
    """The planted bug, on the host's acceptance: every draft the target could emit is accepted (u = 0 < p/q).
    (The device's, planted in its graph: tests/test_device_sampling.py.)"""
    exact = sampling.speculative_accept

    def accept_without_ratio(p, q, drafts, u_accept, u_emit):
        return exact(p, q, drafts, np.zeros_like(u_accept), u_emit)

    monkeypatch.setattr(sampling, "speculative_accept", accept_without_ratio)
    tokens, _ = first_tokens(model, 3, seed=200, fused_verify=False)
    assert homogeneity_p_value(plain, tokens) < ALPHA
