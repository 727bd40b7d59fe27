"""The pitfalls of docs/design.md, planted one at a time: the exactness check must catch each.

A check that passes with a bug planted proves nothing, so each test plants one bug class
from the peers' history and asserts that the state comparison (batch 3, k = 3) fails.
The bugs planted in what the runtime hands the MTP head's own Run (``MTPHead.catch_up``) run
with ``fused_verify=False``: a greedy step otherwise runs the head inside the verify's graph,
where no runtime code hands it anything (tests/test_fused_verify.py plants that graph's bugs).
"""

from __future__ import annotations

import numpy as np
import pytest

import ortspec
from ortspec.runtime.arrays import HostArrays
from ortspec.runtime.graphs import GraphSet
from ortspec.runtime.model import MTPHead
from ortspec.speculative.exactness import ExactnessError, check_speculative

PROMPTS = [[5, 17, 99, 3, 250, 7, 11], [42], [8, 8, 8, 300, 1, 2, 3, 4, 5, 6, 7]]


@pytest.fixture
def graphs(models):
    return GraphSet(ortspec.Session(models.converted("base")).manifest)


def test_clean_run_passes(graphs):
    check_speculative(graphs, PROMPTS, 24, 3, "select", p=0.6)


def test_token_axis_buffer_sized_by_requests(graphs, monkeypatch):
    """The hidden states handed to the MTP head held one row per request, not per token."""
    original = MTPHead.catch_up

    def sized_by_requests(self, rows, hidden, next_ids, positions, last, drafts, graphed=True):
        B, M, H = hidden.shape
        per_request = hidden.reshape(B * M, H)[:B]  # a [B, H] buffer read as if it were [B*M, H]
        return original(self, rows, np.repeat(per_request[:, None], M, axis=1), next_ids, positions, last, drafts,
                        graphed)

    monkeypatch.setattr(MTPHead, "catch_up", sized_by_requests)
    with pytest.raises(ExactnessError, match="MTP state"):
        check_speculative(graphs, PROMPTS, 24, 3, "select", p=0.6, fused_verify=False)


def test_stale_input_on_a_preplanned_path(graphs, monkeypatch):
    """ids and positions refreshed, but the hidden-state input left from the last round."""
    original, previous = MTPHead.catch_up, {}

    def stale_hidden(self, rows, hidden, next_ids, positions, last, drafts, graphed=True):
        key = hidden.shape
        stale = previous.get(key, hidden)
        previous[key] = hidden.copy()
        return original(self, rows, stale, next_ids, positions, last, drafts, graphed)

    monkeypatch.setattr(MTPHead, "catch_up", stale_hidden)
    with pytest.raises(ExactnessError, match="MTP state"):
        check_speculative(graphs, PROMPTS, 24, 3, "select", p=0.6, fused_verify=False)


def test_outputs_sliced_by_request_rows(graphs, monkeypatch):
    """Verify outputs are [M, B, ...] token rows; taking rows [:B] of the flattened window
    looks right for request 0 at slot 0 and is wrong for the rest of the batch."""

    def sliced_by_requests(self, window, index, live):
        flat = np.concatenate(list(window))  # [M*B, ...] (window: [M, B, ...], or M per-row arrays [B, ...])
        live[...] = flat[: len(index)]

    monkeypatch.setattr(HostArrays, "select", sliced_by_requests)
    with pytest.raises(ExactnessError, match="target state"):
        check_speculative(graphs, PROMPTS, 24, 3, "select", p=0.6)


def test_drafts_from_the_wrong_row(graphs, monkeypatch):
    """The head's drafts for the next step must start from the last accepted row a; drafting
    from row 0 (the first verify position) keeps every cache entry right and only the drafts
    wrong, which the comparison of the proposed drafts catches."""
    original = MTPHead.catch_up

    def drafts_from_row_zero(self, rows, hidden, next_ids, positions, last, count, graphed=True):
        drafts = original(self, rows, hidden, next_ids, positions, last, count, graphed)
        wrong = original(self, rows, hidden, next_ids, positions, np.zeros_like(last), count, graphed)
        original(self, rows, hidden, next_ids, positions, last, count, graphed)  # the cache as the real run left it
        return wrong if (last > 0).any() else drafts

    monkeypatch.setattr(MTPHead, "catch_up", drafts_from_row_zero)
    with pytest.raises(ExactnessError, match="next drafts"):
        check_speculative(graphs, PROMPTS, 24, 3, "select", p=0.6, fused_verify=False)
