"""Continuous batching: staggered arrivals, different lengths, different finish times. Every
request's tokens, and its states after every commit, equal those it gets decoded alone."""

from __future__ import annotations

import pytest

import ortspec
from ortspec.runtime.graphs import GraphSet
from ortspec.runtime.graph_slots import batch_bucket
from ortspec.speculative.batcher import run_arrivals
from ortspec.speculative.decoder import Decoder
from ortspec.speculative.drafts import MTPDrafts, ScriptedDrafts
from ortspec.speculative.exactness import ExactnessError, plain_decode_states, row_state
from ortspec.speculative.k_policy import FixedK

REQUESTS = [([5, 17, 99, 3, 250, 7, 11], 30), ([42], 45), ([8, 8, 8, 300, 1, 2, 3, 4, 5, 6, 7, 8, 9], 12),
            ([1, 2], 25), ([400, 3, 3, 3], 40), ([77] * 20, 18)]


def solo_references(graphs, k):
    """Per request: its plain-decode tokens and states, decoded alone (row 0)."""
    refs = {}
    for prompt, n in REQUESTS:
        oracle, table = plain_decode_states(graphs, [prompt], n + k + 1, k)
        refs[tuple(prompt)] = (oracle[0], {T: state for (_, T), state in table.items()})
    return refs


def run_staggered(session, refs=None, p=0.7, fixed_rows=None, max_batch_size=3, wait=True, **options):
    """Adds a request every other step while rows are free; checks states after every commit
    (at depth 1: wherever no step is in flight, at each join and at the end)."""
    checked = []
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
                diffs = row_state(decoder.engine, req).differences(table[req.processed], head=decoder.head is not None)
                if diffs:
                    raise ExactnessError(f"request {req.prompt[:3]}... at length {req.processed}: {', '.join(diffs)}")
                checked.append(req.processed)

        done_rows = set()
        vocab = session.manifest.spec.vocab_size
        options.update(on_commit=compare)
        if p is not None:  # drafts right with probability p (None: the MTP head's own)
            options["make_drafts"] = lambda mtp: ScriptedDrafts(
                MTPDrafts(mtp), lambda r: r.tokens if r.placeholder else refs[tuple(r.prompt)][0], vocab, p=p, seed=3)
    if fixed_rows is not None:
        options["fixed_rows"] = fixed_rows
    return run_arrivals(session.batcher(max_batch_size=max_batch_size, **options), REQUESTS, wait=wait), checked


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


@pytest.mark.parametrize("k", [0, 2])
def test_joins_behind_a_step_in_flight_equal_solo_decoding(models, monkeypatch, k):
    """Depth 1 (the CUDA loop, here on the CPU): a join's prefill is enqueued behind the step in
    flight, over a row that step runs as a finished placeholder, and that step is read out after
    it. Tokens equal solo decoding, and states at every join and at the end; the steps read out
    at a join are counted but not timed for the k policy."""
    out = models.converted("mixed")
    solo = [ortspec.Session(out).generate(prompt, max_new_tokens=n) for prompt, n in REQUESTS]
    session = ortspec.Session(out, num_speculative_tokens=k)
    behind, prefill_forward = [], Decoder._prefill_forward

    def recorded(decoder, requests, copies):
        behind.append(decoder._pipe.flight is not None)
        return prefill_forward(decoder, requests, copies)

    timed, drained_steps, record = [], [], Decoder._record

    def noted(decoder, flight, result, drained=False):
        if drained:
            drained_steps.append(any(not r.done for r in flight.run.requests))
        return record(decoder, flight, result, drained)

    monkeypatch.setattr(Decoder, "_prefill_forward", recorded)
    monkeypatch.setattr(Decoder, "_record", noted)
    monkeypatch.setattr(FixedK, "record", lambda policy, step: timed.append(step.k))
    stats_before = session.stats["steps"]
    outputs, checked = run_staggered(session, refs=solo_references(GraphSet(session.manifest), k), p=None,
                                     fixed_rows=True, pipelined=True)  # the head's drafts: fused steps run ahead
    assert outputs == solo and len(checked) >= len(REQUESTS)
    assert sum(behind) >= 2  # joins did go in behind a step in flight
    assert sum(drained_steps) >= 2  # steps read at a join: counted, not told to the k policy
    assert len(timed) + sum(drained_steps) == session.stats["steps"] - stats_before


def test_sampled_joins_behind_a_step_in_flight_draw_as_if_alone(models):
    """Sampled requests joining a depth-1 batch (fused sampled steps in flight) draw what each
    draws in a generate call of its own with its seed."""
    session = ortspec.Session(models.converted("mixed"), num_speculative_tokens=2)
    sampling = dict(temperature=0.8, top_p=0.9)
    alone = [session.generate(p, max_new_tokens=n, seed=i, **sampling) for i, (p, n) in enumerate(REQUESTS)]
    ids, queue, step = [], list(enumerate(REQUESTS)), 0
    with session.batcher(max_batch_size=3, fixed_rows=True, pipelined=True) as batcher:
        while queue or batcher.pending:
            if queue and step % 2 == 0 and len(batcher.running) < batcher.max_batch_size:
                i, (prompt, n) = queue.pop(0)
                ids.append(batcher.add_request(prompt, max_new_tokens=n, seed=i, **sampling))
            if batcher.pending:
                batcher.step()
            step += 1
        assert [batcher.result(i) for i in ids] == alone
    assert session.stats["pipelined_speculative_steps"] > 0


def test_fixed_rows_step_the_rows_up_to_the_last_running_one_bucketed(models, monkeypatch):
    """The CUDA batching steps rows 0.. up to the last running request's, rounded up to a batch
    bucket (1, 2, 4, then the engine's 6): a server with one request steps one row. States are
    checked after every commit while the runs grow and shrink."""
    out = models.converted("mixed")
    solo = [ortspec.Session(out).generate(prompt, max_new_tokens=n) for prompt, n in REQUESTS]
    session = ortspec.Session(out, num_speculative_tokens=2)
    stepped, step_rows = [], Decoder._step_rows

    def recorded(decoder, running):
        rows = step_rows(decoder, running)
        last = max(r.row for r in running)
        assert [r.row for r in rows] == list(range(min(batch_bucket(last + 1), len(decoder.occupants))))
        stepped.append(len(rows))
        return rows

    monkeypatch.setattr(Decoder, "_step_rows", recorded)
    outputs, checked = run_staggered(session, refs=solo_references(GraphSet(session.manifest), 2), fixed_rows=True,
                                     max_batch_size=6)
    assert outputs == solo and len(checked) > 60
    assert {1, 2, 4, 6} <= set(stepped)


@pytest.mark.parametrize("fixed_rows", [False, True])
def test_warm_up_leaves_no_request_and_no_counters(models, fixed_rows):
    """Batcher.warm_up (a server's first turn) steps every batch bucket where steps run fixed rows
    (one row where they run the running rows only), then serves as if it had not run: no request,
    the Session's stats as they were, requests equal solo decoding."""
    out = models.converted("base")
    solo = [ortspec.Session(out).generate(prompt, max_new_tokens=n) for prompt, n in REQUESTS]
    session = ortspec.Session(out, num_speculative_tokens=2)
    with session.batcher(max_batch_size=5, fixed_rows=fixed_rows) as batcher:
        before = session.stats
        steps = []
        original = batcher.step
        batcher.step = lambda: (steps.append(len(batcher.running)), original())[1]
        batcher.warm_up()
        buckets = [1, 2, 4, 5] if fixed_rows else [1]
        assert sorted(set(steps)) == buckets and len(steps) >= 3 * len(buckets) and batcher.requests == {}
        assert batcher.pending == []
        assert {key: session.stats[key] for key in ("steps", "requests", "generated_tokens")} == \
            {key: before[key] for key in ("steps", "requests", "generated_tokens")}
        del batcher.step
        assert run_arrivals(batcher, REQUESTS) == solo


def test_auto_ks_warm_up_runs_every_k_and_switch_and_measures_nothing(models, monkeypatch):
    """With auto k a server's requests may run any k and switch between neighbours (a switch runs
    the head in a Run of its own): its warm-up runs each, greedy and sampled, and leaves auto k's
    windows empty."""
    from ortspec.speculative.decoder import Decoder

    session = ortspec.Session(models.converted("base"), num_speculative_tokens="auto")
    seen = set()
    original = Decoder._record
    monkeypatch.setattr(Decoder, "_record", lambda self, flight, result: (
        seen.add((flight.plan.k, flight.plan.drafts, any(r.samples for r in flight.run.requests))),
        original(self, flight, result))[1])
    with session.batcher(max_batch_size=2) as batcher:
        batcher.warm_up()
        assert batcher.requests == {}
    ks = range(session.k + 1)
    steady = {(k, k) for k in ks}
    switches = {(k, k + 1) for k in ks[:-1]} | {(k + 1, k) for k in ks[:-1]}
    for sampled in (False, True):
        assert steady | switches <= {(k, d) for k, d, s in seen if s == sampled}
    assert session.stats["auto_k"]["windows"] == {}


def test_report_hands_over_the_first_tokens_before_a_step(models):
    """report(): what step() would report, without a step; the tokens are not reported twice."""
    session = ortspec.Session(models.converted("base"), num_speculative_tokens=2)
    [prompt, n] = REQUESTS[0]
    with session.batcher(max_batch_size=2) as batcher:
        rid = batcher.add_request(prompt, max_new_tokens=n)
        steps = session.stats["steps"]
        first = batcher.report()
        assert first == {rid: batcher.result(rid)} and len(first[rid]) == 1 and session.stats["steps"] == steps
        assert batcher.report() == {rid: []}
        tokens = list(first[rid])
        while batcher.pending:
            tokens += batcher.step()[rid]
        assert tokens == batcher.result(rid) == ortspec.Session(models.converted("base")).generate(prompt,
                                                                                                  max_new_tokens=n)


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


@pytest.mark.parametrize("fixed_rows", [False, True])
def test_choices_of_one_prompt_are_prefilled_once_and_equal_one_greedy_row(models, monkeypatch, fixed_rows):
    """add_requests with one prompt three times (an API request's n = 3 choices, greedy) beside
    another prompt: one prefill row per distinct prompt, and each choice's tokens and states after
    every commit (target, GDN, MTP head) those of the prompt decoded alone; k = 2."""
    from ortspec.runtime.model import TargetModel

    out, k = models.converted("base"), 2
    session = ortspec.Session(out, num_speculative_tokens=k)
    prompt, other = REQUESTS[0][0], REQUESTS[3][0]
    oracle, table = plain_decode_states(session.graphs, [prompt, other], 40, k)
    refs = {tuple(prompt): {T: s for (row, T), s in table.items() if row == 0},
            tuple(other): {T: s for (row, T), s in table.items() if row == 1}}
    checked, prefilled = [], []
    prefill = TargetModel.prefill
    monkeypatch.setattr(TargetModel, "prefill", lambda self, rows, ids, positions, **options: (
        prefilled.extend(map(tuple, ids.tolist())), prefill(self, rows, ids, positions, **options))[1])

    def compare(decoder, batch):
        for req in batch.requests:
            if req.placeholder or req.done:
                continue
            diffs = row_state(decoder.engine, req).differences(refs[tuple(req.prompt)][req.processed])
            assert not diffs, f"choice in row {req.row} at length {req.processed}: {', '.join(diffs)}"
            checked.append(req.row)

    with session.batcher(max_batch_size=4, on_commit=compare, fixed_rows=fixed_rows) as batcher:
        ids = batcher.add_requests([dict(prompt=prompt, max_new_tokens=20)] * 3 + [dict(prompt=other, max_new_tokens=20)])
        assert sorted(t for t in prefilled if t in refs) == sorted(refs)  # one row per distinct prompt
        while batcher.pending:
            batcher.step()
        results = [batcher.result(i) for i in ids]
    solo = session.generate(prompt, max_new_tokens=20)
    assert results[:3] == [solo] * 3 and results[3] == session.generate(other, max_new_tokens=20)
    assert len(set(checked)) == 4


def test_sampled_choices_of_one_prompt_draw_as_if_each_was_added_alone(models):
    """Three sampled choices of one prompt (seed 5, seed_index 0..2) added together, prefilled
    once, get the tokens each gets added alone to a batcher of its own; a request's n choices stay
    different from each other."""
    session = ortspec.Session(models.converted("base"), num_speculative_tokens=2)
    prompt = REQUESTS[0][0]
    choices = [dict(prompt=prompt, max_new_tokens=24, temperature=0.9, seed=5, seed_index=i) for i in range(3)]
    with session.batcher(max_batch_size=3) as batcher:
        ids = batcher.add_requests(choices)
        while batcher.pending:
            batcher.step()
        together = [batcher.result(i) for i in ids]
    alone = []
    for options in choices:
        with session.batcher(max_batch_size=1) as batcher:
            rid = batcher.add_request(**options)
            while batcher.pending:
                batcher.step()
            alone.append(batcher.result(rid))
    assert together == alone and len({tuple(t) for t in together}) > 1


def test_add_requests_is_all_or_none(models):
    """One bad request among three: an InputError, no ids, no row taken; too few free rows: the
    same, naming how many rows are free."""
    session = ortspec.Session(models.converted("base"))
    with session.batcher(max_batch_size=3) as batcher:
        with pytest.raises(ortspec.InputError):
            batcher.add_requests([dict(prompt=[1, 2]), dict(prompt=[1, 2], temperature=-1.0), dict(prompt=[3])])
        assert batcher.pending == [] and all(r is None or r.done for r in batcher.rows)
        batcher.add_request([4, 5], max_new_tokens=30)
        with pytest.raises(ortspec.InputError, match="2 of 3 rows are free, for 3 requests"):
            batcher.add_requests([dict(prompt=[1, 2])] * 3)
        assert len(batcher.pending) == 1
