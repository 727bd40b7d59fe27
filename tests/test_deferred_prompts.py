"""Auto k defers the MTP head's catch-up over a prompt when the next step is a plain decode (k = 0):
the prompt's entries wait in ``DeferredEntries`` beside the decode steps' and run first at the
next catch-up. Tokens equal greedy and, whenever nothing waits, the head's state equals a plain
decode's bitwise (CPU)."""

from __future__ import annotations

import pytest

import ortspec
from ortspec.runtime.model import MTPHead
from ortspec.speculative.auto_k import ScriptedK
from ortspec.speculative.decoder import Decoder
from ortspec.speculative.deferred_entries import PromptEntries
from ortspec.speculative.exactness import ExactnessError, check_speculative, make_requests, plain_decode_states
from ortspec.speculative.exactness import row_state
from ortspec.speculative.head import Head
from ortspec.speculative.stats import Stats
from tests.test_auto_pipelined import graphs  # noqa: F401  (a fixture: the base model's graphs)

# rows 0 and 1 share a length: on the CPU they are prefilled (and their entries deferred) as one group
PROMPTS = [[5, 17, 99, 3, 250, 7, 11], [42, 1, 2, 3, 4, 5, 6], [8, 8, 8, 300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
NEW_TOKENS = 40
SCRIPT = [0, 0, 0, 2, 0, 0, 3, 1, 0, 4]  # starts with k = 0: the prefill defers its head entries


@pytest.fixture(scope="module")
def reference(graphs):
    return plain_decode_states(graphs, PROMPTS, NEW_TOKENS + 4 + 1, 4)


def count_eager_catch_ups(monkeypatch) -> list:
    """Records the rows of every eager (not graphed) head catch-up: the prefill's and the deferred ones."""
    calls, original = [], MTPHead.catch_up

    def counted(self, rows, hidden, next_ids, positions, last, drafts, graphed=True):
        if not graphed:
            calls.append((rows.indices.tolist(), positions.shape[1]))
        return original(self, rows, hidden, next_ids, positions, last, drafts, graphed)

    monkeypatch.setattr(MTPHead, "catch_up", counted)
    return calls


def test_a_prefill_before_a_plain_step_runs_no_head(graphs, monkeypatch):
    calls = count_eager_catch_ups(monkeypatch)
    decoder = Decoder(graphs, 3, 4, "select", Stats(), k_chooser=ScriptedK(4, [0]))
    decoder.admit(make_requests(PROMPTS, 4))
    assert calls == [] and decoder.head.waiting and not decoder.head.deferred.has_steps
    # a fixed k (or an auto step that speculates next) catches up before its first step
    decoder = Decoder(graphs, 3, 4, "select", Stats(), k_chooser=ScriptedK(4, [2]))
    decoder.admit(make_requests(PROMPTS, 4)[:1])
    assert calls == [] and decoder.head.waiting
    decoder.step()
    assert calls == [([0], 7)] and not decoder.head.waiting


@pytest.mark.parametrize("commit", ["select", "readvance"])
@pytest.mark.parametrize("fixed_rows", [False, True])
def test_deferred_prompts_are_exact(graphs, reference, monkeypatch, commit, fixed_rows):
    calls = count_eager_catch_ups(monkeypatch)
    stats = check_speculative(graphs, PROMPTS, NEW_TOKENS, 4, commit, p=0.7, seed=2, reference=reference,
                              fixed_rows=fixed_rows, k_chooser=ScriptedK(4, SCRIPT))
    assert stats.steps_by_k[0] > 5 and sum(stats.steps_by_k[1:]) > 5, stats.steps_by_k
    # the first catch-up (before the script's first k > 0 speculates): the prompts of both prefill
    # groups in one run (consecutive rows, padded to the longest), then the k = 0 steps' entries: 3
    # (the call's first k, chosen with its tail once the prompts are in, then one per step)
    assert calls[:2] == [([0, 1, 2], 16), ([0, 1, 2], 3)]


def test_deferred_prompts_in_pipelined_stretches_are_exact(graphs, reference):
    check_speculative(graphs, PROMPTS, NEW_TOKENS, 4, "select", p=0.7, seed=4, reference=reference,
                      fixed_rows=True, pipelined=True, k_chooser=ScriptedK(4, [0] * 9 + [2] + [0] * 6 + [3, 1]))


def test_prompts_flushed_after_the_decode_entries_are_caught(graphs, reference, monkeypatch):
    """Planted bug: the head's entries out of order (a prompt's after the steps that follow it)."""
    def wrong_order(self, drafts):
        if self.deferred.has_steps:
            for requests, rows, hidden, next_ids, positions, last in self.deferred.take():
                self.catch_up(rows, hidden, next_ids, positions, last, requests, drafts, graphed=False)
        for requests, rows, hidden, next_ids, positions, last in self.deferred.take_prompts():
            self.catch_up(rows, hidden, next_ids, positions, last, requests, drafts, graphed=False)

    monkeypatch.setattr(Head, "catch_up_deferred", wrong_order)
    with pytest.raises(ExactnessError, match="MTP state|next drafts"):
        check_speculative(graphs, PROMPTS, 20, 4, "select", p=0.7, reference=reference,
                          k_chooser=ScriptedK(4, SCRIPT))


def test_prompt_entries_one_position_off_are_caught(graphs, reference, monkeypatch):
    original = PromptEntries.catch_up_inputs

    def shifted(self, arrays):
        requests, rows, hidden, next_ids, positions, last = original(self, arrays)
        return requests, rows, hidden, next_ids, positions + 1, last

    monkeypatch.setattr(PromptEntries, "catch_up_inputs", shifted)
    with pytest.raises(ExactnessError, match="MTP state|next drafts"):
        check_speculative(graphs, PROMPTS, 20, 4, "select", p=0.7, reference=reference,
                          k_chooser=ScriptedK(4, SCRIPT))


def states_checker(graphs, requests: list[tuple[list[int], int]], checked: list):
    """An on_commit hook: whenever no head entry waits, every live row's state, the head's
    included, equals a plain decode of its request (each (row, length) checked appended to checked)."""
    plain = {tuple(p): plain_decode_states(graphs, [p], n + 4 + 1, 4)[1] for p, n in requests}

    def compare(decoder, batch):
        for req in batch.requests:
            if req.placeholder or req.done or decoder.head.waiting:
                continue
            diffs = row_state(decoder.engine, req).differences(plain[tuple(req.prompt)][(0, req.processed)])
            assert not diffs, (req.row, req.processed, diffs)
            checked.append((req.row, req.processed))

    return compare


def test_batcher_arrivals_and_a_reused_row(models, graphs, monkeypatch):
    """A batcher whose requests arrive while entries wait: tokens equal greedy, the head's state
    equals a plain decode of each request whenever nothing waits, and a row reused by a new request
    drops its last request's waiting prompt entries (that request finished at its prefill)."""
    out = models.converted("base")
    prompts = [PROMPTS[2], PROMPTS[0], PROMPTS[1]]
    greedy = ortspec.Session(out).generate(prompts, max_new_tokens=24)
    checked = []
    compare = states_checker(graphs, [(p, 24) for p in prompts], checked)

    session = ortspec.Session(out, num_speculative_tokens="auto")
    session.k_chooser = ScriptedK(4, [0, 0, 0, 0, 2, 0, 0, 3])
    calls = count_eager_catch_ups(monkeypatch)
    with session.batcher(max_batch_size=2, on_commit=compare) as batcher:
        short = batcher.add_request(PROMPTS[1], max_new_tokens=1)  # done at its prefill, its entries waiting
        ids = [batcher.add_request(prompts[0], max_new_tokens=24)]  # takes the short request's row 0
        batcher.step()
        ids.append(batcher.add_request(prompts[1], max_new_tokens=24))  # a step's entries wait: all catch up
        batcher.step()
        while len(ids) < 3 or batcher.pending:
            if len(ids) < 3 and len(batcher.running) < 2:
                ids.append(batcher.add_request(prompts[2], max_new_tokens=24))
            batcher.step()
        assert [batcher.result(i) for i in ids] == greedy and batcher.result(short) == greedy[2][:1]
    assert checked and {row for row, _ in checked} >= {0, 1}
    # no catch-up at the join: at the first step that drafts, rows 0 and 1's prompts in one run (padded
    # to the longest), then their steps' entries in one (row 1, a step later, padded); the short
    # request's entries never ran
    assert calls[:2] == [([0, 1], 16), ([0, 1], 4)]


@pytest.mark.parametrize("fixed_rows,pipelined,bound", [(False, False, None), (True, False, None), (True, True, None),
                                                        (False, False, 3), (True, True, 3)])
def test_joins_in_a_plain_stretch_catch_nobody_up_and_stay_exact(models, graphs, monkeypatch, fixed_rows, pipelined,
                                                                 bound):
    """Requests join while auto k's k = 0 stretches leave entries: no catch-up runs at a join (a
    joining row's entries start with its first step, padded at the catch-up), tokens equal
    greedy, and whenever nothing waits every row's state, the head's included, equals a plain
    decode of its request (CPU, bitwise). bound: MAX_STEPS, reached in a stretch (the head then
    catches up although no step drafts, and no more steps wait)."""
    from ortspec.speculative import deferred_entries
    from tests.test_batching import REQUESTS

    if bound is not None:
        monkeypatch.setattr(deferred_entries, "MAX_STEPS", bound)

    out = models.converted("base")
    greedy = [ortspec.Session(out).generate(prompt, max_new_tokens=n) for prompt, n in REQUESTS]
    checked = []
    compare = states_checker(graphs, REQUESTS, checked)

    session = ortspec.Session(out, num_speculative_tokens="auto")
    session.k_chooser = ScriptedK(4, [0] * 7 + [2] + [0] * 5 + [3, 1])
    calls = count_eager_catch_ups(monkeypatch)
    joins, waiting = [], []
    with session.batcher(max_batch_size=3, on_commit=compare, fixed_rows=fixed_rows, pipelined=pipelined) as batcher:
        queue, ids, steps = list(REQUESTS), [], 0
        while queue or batcher.pending:
            if queue and steps % 2 == 0 and len(batcher.running) < 3:
                prompt, n = queue.pop(0)
                before = len(calls)
                ids.append(batcher.add_request(prompt, max_new_tokens=n))
                joins.append(len(calls) - before)
            if batcher.pending:
                batcher.step()
                waiting.append(len(batcher.decoder.head.deferred._steps))
            steps += 1
        assert [batcher.result(i) for i in ids] == greedy
    assert len(checked) > 20
    if bound is None:  # with one, a join's drain may read the step that reached it
        assert sum(joins) == 0  # no join ran the head
    assert max(waiting) <= (bound if bound is not None else 7)  # the script's longest stretch: 7 steps
