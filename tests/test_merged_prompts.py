"""The MTP head catches up over all of a generate call's prompts in one run per range of
consecutive rows (``DeferredEntries.take_prompts``): prompts of different lengths padded to the
longest, each row's entries past its last one never written. On the CPU (float32 activations)
tokens equal greedy and every state equals a plain decode's bitwise after every commit."""

from __future__ import annotations

import numpy as np
import pytest

import ortspec
from ortspec.runtime.states import Rows
from ortspec.speculative.auto_k import ScriptedK
from ortspec.speculative.decoder import Decoder
from ortspec.speculative.deferred_entries import DeferredEntries, PromptEntries
from ortspec.speculative.exactness import ExactnessError, check_speculative, make_requests, plain_decode_states
from ortspec.speculative.stats import Stats
from tests.test_auto_pipelined import graphs  # noqa: F401  (a fixture: the base model's graphs)
from tests.test_deferred_prompts import count_eager_catch_ups as eager_catch_ups

PROMPTS = [[5], [5, 17, 99, 3, 250, 7, 11], list(range(3, 16)), list(range(20, 50))]  # 1, 7, 13, 30 tokens
NEW_TOKENS = 24
K = 3


@pytest.fixture(scope="module")
def reference(graphs):
    return plain_decode_states(graphs, PROMPTS, NEW_TOKENS + K + 1, K)


@pytest.mark.parametrize("commit", ["select", "readvance"])
@pytest.mark.parametrize("fixed_rows", [False, True])
@pytest.mark.parametrize("k", [2, 3])
def test_merged_prompts_are_exact(graphs, reference, monkeypatch, commit, fixed_rows, k):
    calls = eager_catch_ups(monkeypatch)
    check_speculative(graphs, PROMPTS, NEW_TOKENS, k, commit, p=0.6, seed=k, reference=reference,
                      fixed_rows=fixed_rows)
    assert calls == [([0, 1, 2, 3], 30)]  # the four prompts in one run, the longest's width


@pytest.mark.parametrize("script", [[0, 0, 2, 0, 3, 1, 0], [3, 0, 0, 2, 0, 1, 3]])
def test_auto_k_merged_prompts_are_exact(graphs, reference, monkeypatch, script):
    """From k = 0 the prompts wait for the first speculative step (with the steps' entries after
    them); from k = 3 they catch up in one run before the first step."""
    calls = eager_catch_ups(monkeypatch)
    check_speculative(graphs, PROMPTS, NEW_TOKENS, K, "select", p=0.6, reference=reference,
                      fixed_rows=True, k_chooser=ScriptedK(K, script))
    assert calls[0] == ([0, 1, 2, 3], 30)


def test_one_head_run_at_a_prefill_of_mixed_lengths(graphs, monkeypatch):
    calls = eager_catch_ups(monkeypatch)
    decoder = Decoder(graphs, 4, 2, "select", Stats())
    steps = decoder.steps(make_requests(PROMPTS, 8))
    next(steps), next(steps)  # the prefill, then the first step: the head caught up before it
    assert calls == [([0, 1, 2, 3], 30)]
    calls.clear()
    decoder = Decoder(graphs, 4, 2, "select", Stats())
    decoder.head.deferred.pad_lengths = False  # float16 activations on the CPU: one run per length
    steps = decoder.steps(make_requests(PROMPTS, 8))
    next(steps), next(steps)
    assert calls == [([0], 1), ([1], 7), ([2], 13), ([3], 30)]


def test_greedy_and_batcher_tokens(models):
    """Speculative output equals greedy for mixed lengths; a batcher (requests joining one at a
    time, auto k deferring from k = 0) too."""
    out = models.converted("base")
    greedy = ortspec.Session(out).generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    for k in (2, 3):
        assert ortspec.Session(out, num_speculative_tokens=k).generate(PROMPTS, max_new_tokens=NEW_TOKENS) == greedy
    session = ortspec.Session(out, num_speculative_tokens="auto")
    session.k_chooser = ScriptedK(K, [0, 0, 2, 0, 3])
    with session.batcher(max_batch_size=4) as batcher:
        ids = [batcher.add_request(PROMPTS[0], max_new_tokens=NEW_TOKENS),
               batcher.add_request(PROMPTS[1], max_new_tokens=NEW_TOKENS)]
        batcher.step()
        ids += [batcher.add_request(p, max_new_tokens=NEW_TOKENS) for p in PROMPTS[2:]]
        while batcher.pending:
            batcher.step()
        assert [batcher.result(i) for i in ids] == greedy


class HostArrays:
    device = "cpu"

    def download(self, x):
        return np.asarray(x)

    def from_host(self, x, dtype):
        return x


def test_runs_follow_consecutive_rows():
    """Rows waiting out of order merge in row order; a gap in the rows starts another run."""
    entries = DeferredEntries(HostArrays())
    for row, n in [(2, 3), (0, 5), (1, 1), (5, 2)]:
        hidden = np.full((1, n, 2), float(row))  # [1, n, H]: the row's number, to follow it
        entries.add_prompts([f"r{row}"], Rows([row]), hidden, np.full((1, n), row))
    runs = entries.take_prompts()
    assert [(rows.indices.tolist(), last.tolist()) for _, rows, _, _, _, last in runs] == [([0, 1, 2], [4, 0, 2]),
                                                                                          ([5], [1])]
    requests, _, hidden, next_ids, positions, _ = runs[0]
    assert requests == ["r0", "r1", "r2"] and hidden.shape == (3, 5, 2) and positions.tolist()[1] == [0, 1, 2, 3, 4]
    assert hidden[1, 0, 0] == 1 and not hidden[1, 1:].any() and next_ids[2].tolist() == [2, 2, 2, 0, 0]
    assert not entries


@pytest.mark.parametrize("bug", ["last one short", "rows out of order"])
def test_planted_merge_bugs_are_caught(graphs, reference, monkeypatch, bug):
    original = PromptEntries.catch_up_inputs

    def planted(self, arrays):
        requests, rows, hidden, next_ids, positions, last = original(self, arrays)
        if bug == "last one short":
            return requests, rows, hidden, next_ids, positions, np.maximum(last - 1, 0)
        return requests, rows, hidden[::-1].copy(), next_ids[::-1].copy(), positions, last[::-1].copy()

    monkeypatch.setattr(PromptEntries, "catch_up_inputs", planted)
    with pytest.raises(ExactnessError, match="MTP state|next drafts"):
        check_speculative(graphs, PROMPTS, 8, K, "select", p=0.6, reference=reference)
