"""Continuous batching: staggered arrivals, different lengths, different finish times. Every
request's tokens, and its states after every commit, equal those it gets decoded alone."""

from __future__ import annotations

import pytest

import ortspec
from ortspec.runtime.graphs import GraphSet
from ortspec.speculative.batcher import run_arrivals
from ortspec.speculative.drafts import MTPDrafts, ScriptedDrafts
from ortspec.speculative.exactness import ExactnessError, plain_decode_states, row_state

REQUESTS = [([5, 17, 99, 3, 250, 7, 11], 30), ([42], 45), ([8, 8, 8, 300, 1, 2, 3, 4, 5, 6, 7, 8, 9], 12),
            ([1, 2], 25), ([400, 3, 3, 3], 40), ([77] * 20, 18)]


def solo_references(graphs, k):
    """Per request: its plain-decode tokens and states, decoded alone (row 0)."""
    refs = {}
    for prompt, n in REQUESTS:
        oracle, table = plain_decode_states(graphs, [prompt], n + k + 1, k)
        refs[tuple(prompt)] = (oracle[0], {T: state for (_, T), state in table.items()})
    return refs


def run_staggered(session, refs=None, p=0.7, fixed_rows=None, max_batch_size=3):
    """Adds a request every other step while rows are free; checks states after every commit."""
    checked = []
    options = {}
    if refs is not None:
        def compare(decoder, batch):
            for req in batch.requests:
                if req.done and (req.row, id(req)) in done_rows:
                    continue
                if req.done:
                    done_rows.add((req.row, id(req)))
                if req.placeholder:
                    continue  # fills a free row in the fixed-rows batching
                tokens, table = refs[tuple(req.prompt)]
                diffs = row_state(decoder.engine, req).differences(table[req.processed])
                if diffs:
                    raise ExactnessError(f"request {req.prompt[:3]}... at length {req.processed}: {', '.join(diffs)}")
                checked.append(req.processed)

        done_rows = set()
        vocab = session.manifest.spec.vocab_size
        options = dict(on_commit=compare, make_drafts=lambda mtp: ScriptedDrafts(
            MTPDrafts(mtp), lambda r: r.tokens if r.placeholder else refs[tuple(r.prompt)][0], vocab, p=p, seed=3))
    if fixed_rows is not None:
        options["fixed_rows"] = fixed_rows
    return run_arrivals(session.batcher(max_batch_size=max_batch_size, **options), REQUESTS), checked


@pytest.mark.parametrize("commit", ["select", "readvance"])
@pytest.mark.parametrize("k", [2, 3])
def test_staggered_arrivals_equal_solo_decoding(models, commit, k):
    out = models.converted("base")
    solo = [ortspec.Session(out).generate(prompt, max_new_tokens=n) for prompt, n in REQUESTS]
    session = ortspec.Session(out, num_speculative_tokens=k, commit=commit)
    outputs, _ = run_staggered(session)
    assert outputs == solo
    graphs = GraphSet(session.manifest)
    outputs, checked = run_staggered(session, refs=solo_references(graphs, k))
    assert outputs == solo and len(checked) > 60


def test_staggered_arrivals_with_fixed_rows(models):
    """The CUDA batching (every row runs, free rows hold placeholders), on the CPU."""
    out = models.converted("mixed")
    solo = [ortspec.Session(out).generate(prompt, max_new_tokens=n) for prompt, n in REQUESTS]
    session = ortspec.Session(out, num_speculative_tokens=3)
    graphs = GraphSet(session.manifest)
    outputs, checked = run_staggered(session, refs=solo_references(graphs, 3), fixed_rows=True)
    assert outputs == solo and len(checked) > 60


def test_batcher_errors(models):
    session = ortspec.Session(models.converted("base"), num_speculative_tokens=2)
    batcher = session.batcher(max_batch_size=1)
    rid = batcher.add_request([1, 2, 3], max_new_tokens=5)
    with pytest.raises(ortspec.InputError, match="all 1 rows are busy"):
        batcher.add_request([4], max_new_tokens=5)
    with pytest.raises(ortspec.InputError, match="outside the vocabulary"):
        batcher.add_request([10**6], max_new_tokens=5)
    with pytest.raises(ortspec.InputError, match="no request with id 7"):
        batcher.result(7)
    while batcher.pending:
        batcher.step()
    assert batcher.result(rid) == session.generate([1, 2, 3], max_new_tokens=5)
    assert batcher.add_request([4], max_new_tokens=5) == rid + 1  # the finished row is reused
