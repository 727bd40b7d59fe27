"""num_speculative_tokens="auto": how the chooser decides, and that any sequence of k it chooses
(k = 0 steps leaving the MTP head's entries for later included) is exact."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import ortspec
from ortspec.runtime.graphs import GraphSet
from ortspec.speculative import auto_k
from ortspec.speculative.auto_k import KChooser, ScriptedK, Tail, row_bucket, tail_tokens_per_step
from ortspec.speculative.exactness import ExactnessError, check_speculative, plain_decode_states

PROMPTS = [[5, 17, 99, 3, 250, 7, 11], [42], [8, 8, 8, 300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]


# -- the chooser ---------------------------------------------------------------------------------

def test_acceptance_per_depth_from_accept_lengths():
    chooser = KChooser(3)
    # k=3: a=0 tried 1; a=1 tried 1,2 kept 1; a=3 tried 1,2,3 kept 1,2,3
    for _ in range(200):
        chooser.record_accepts(np.array([0, 1, 3]), 3)
    rates = chooser.acceptance()
    assert rates[0] == pytest.approx(2 / 3, abs=0.01)  # draft 1 kept in 2 of 3 rows
    assert rates[1] == pytest.approx(1 / 2, abs=0.01)  # draft 2 tried by the two rows that kept 1, kept by one
    assert rates[2] == pytest.approx(1.0, abs=0.01)  # draft 3 tried only by the row that kept 2, and kept
    assert chooser.expected_tokens(0) == 1.0
    assert chooser.expected_tokens(2) == pytest.approx(1 + 2 / 3 + 1 / 3, abs=0.02)


def test_acceptance_follows_recent_text():
    chooser = KChooser(2)
    for _ in range(100):
        chooser.record_accepts(np.array([2, 2, 2, 2]), 2)
    high = chooser.acceptance()[0]
    for _ in range(300):
        chooser.record_accepts(np.array([0, 0, 0, 0]), 2)
    assert high > 0.95 and chooser.acceptance()[0] < 0.05


def test_row_buckets():
    assert [row_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]


def time_all(chooser: KChooser, rows: int, costs: dict, times: int = 4) -> None:
    for k, seconds in costs.items():
        for _ in range(times):
            chooser.record_time(rows, k, seconds)


def run_steps(chooser: KChooser, rows: int, steps: int, seconds) -> list[int]:
    """Steps as the Decoder runs them: each step's k chosen before it, and its time recorded
    only when the steps before and after it ran the same k (steady). seconds(k) -> a step's time."""
    chosen = [chooser.choose(rows)]
    for _ in range(steps):
        chosen.append(chooser.choose(rows))
        if len(chosen) >= 3 and chosen[-3] == chosen[-2] == chosen[-1]:
            chooser.record_time(rows, chosen[-2], seconds(chosen[-2]))
    return chosen


def test_every_k_is_tried_in_a_run_whose_inner_steps_time_it():
    chooser = KChooser(3)
    chosen = run_steps(chooser, 1, 4 * auto_k.RUN_STEPS, lambda k: 0.01)
    runs = [list(group) for _, group in itertools.groupby(chosen[: 4 * auto_k.RUN_STEPS])]
    assert [len(r) for r in runs] == [auto_k.RUN_STEPS] * 4 and sorted(r[0] for r in runs) == [0, 1, 2, 3]
    assert all(chooser.cost(1, k) == 0.01 for k in range(4))


def test_a_median_of_three_outlasts_one_outlier():
    chooser = KChooser(1)
    chooser.record_time(4, 1, 0.01)
    chooser.record_time(4, 1, 5.0)  # a capture, say
    assert chooser.cost(4, 1) is None  # 2 < MIN_SAMPLES
    chooser.record_time(4, 1, 0.02)
    assert chooser.cost(4, 1) == pytest.approx(0.02)


def test_chooses_the_most_tokens_per_second():
    chooser = KChooser(4)
    for _ in range(50):
        chooser.record_accepts(np.array([4, 4, 3, 4]), 4)  # drafts almost always right
    time_all(chooser, 1, {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3, 4: 1.4})
    assert chooser.choose(1) == 4
    chooser = KChooser(4)
    for _ in range(50):
        chooser.record_accepts(np.array([0, 0, 0, 1]), 4)  # drafts almost always wrong
    time_all(chooser, 16, {0: 1.0, 1: 1.3, 2: 1.6, 3: 1.9, 4: 2.2})
    assert chooser.choose(16) == 0  # speculation cannot pay: plain greedy


def test_costs_are_per_row_count():
    chooser = KChooser(1)
    for _ in range(50):
        chooser.record_accepts(np.array([1, 0]), 1)  # E(1) ~ 1.5
    time_all(chooser, 1, {0: 1.0, 1: 1.2})  # batch 1: verify nearly free -> k=1
    time_all(chooser, 16, {0: 1.0, 1: 1.9})  # batch 16: verify costs double -> greedy
    assert chooser.choose(1) == 1 and chooser.choose(16) == 0


def test_other_ks_are_tried_again_far_ones_rarely():
    """Every PROBE_EVERY steps a run of another k: a cost timed on a cold or busy machine is
    timed again, k = 0 included, but a k far behind the best only in one slot of FAR_PROBES."""
    chooser = KChooser(3)
    for _ in range(50):
        chooser.record_accepts(np.array([1, 2]), 3)
    costs = {0: 1.0, 1: 1.0, 2: 1.05, 3: 1.5}
    time_all(chooser, 2, costs)
    slots = 3 * auto_k.FAR_PROBES  # every k gets a turn in every FAR_PROBES-th slot
    chosen = run_steps(chooser, 2, slots * auto_k.PROBE_EVERY + auto_k.RUN_STEPS, costs.get)
    best = max(set(chosen), key=chosen.count)
    trials = [(k, len(list(group))) for k, group in itertools.groupby(chosen) if k != best]
    assert best == 2 and all(n == auto_k.RUN_STEPS for _, n in trials)
    # k = 1 (2.0 tokens per unit against the best's 2.38) is near: every slot may take it; k = 3
    # and k = 0 (far behind) only in the every-k slots, once each in three of them
    assert [k for k, _ in trials].count(3) == 1 and [k for k, _ in trials].count(0) == 1
    assert len(trials) == slots and {k for k, _ in trials} == {0, 1, 3}


# -- the static batch's tail ---------------------------------------------------------------------

ACCEPTANCE = np.array([0.8, 0.7, 0.6, 0.5])  # a1..a4
# accept lengths of k = 4 in the proportions those rates give: P(a = i) = a1..ai (1 - a_{i+1}), out of 125
ACCEPT_LENGTHS = np.repeat(np.arange(5), [25, 30, 28, 21, 21])


def simulated_steps(acceptance: np.ndarray, live: int, tokens: int, batches: int, seed: int = 0) -> float:
    """Monte Carlo: the mean over batches of the steps until every one of ``live`` requests has
    ``tokens`` tokens, each step giving a request 1 + (its leading accepted drafts)."""
    rng = np.random.default_rng(seed)
    kept = rng.random((batches, live, tokens, len(acceptance))) < acceptance  # [batches, B, steps, k]
    per_step = np.cumprod(kept, -1).sum(-1) + 1  # [batches, B, steps] t = a + 1
    steps = (np.cumsum(per_step, -1) < tokens).sum(-1) + 1  # [batches, B] the first step reaching N
    return float(steps.max(-1).mean())


@pytest.mark.parametrize("k", [1, 2, 4])
def test_the_slowest_requests_steps_match_a_simulation(k):
    chooser = KChooser(k)
    acceptance = ACCEPTANCE[:k]
    for _ in range(300):  # accept lengths of k drafts in the model's proportions
        chooser.record_accepts(np.minimum(ACCEPT_LENGTHS, k), k)
    np.testing.assert_allclose(chooser.acceptance(), acceptance, atol=0.02)
    predicted = 128 / chooser.batch_tokens(k, Tail(16, 128))
    simulated = simulated_steps(acceptance, 16, 128, batches=400)
    assert predicted == pytest.approx(simulated, rel=0.03)
    assert 128 / chooser.expected_tokens(k) < 0.96 * simulated  # the mean alone misses the tail
    assert chooser.batch_tokens(k, Tail(1, 128)) == chooser.expected_tokens(k)  # one request: no tail
    assert chooser.batch_tokens(0, Tail(16, 128)) == 1.0  # greedy: every request one token a step


def test_tail_of_a_generate_calls_requests():
    from ortspec.speculative.requests import Request

    requests = [Request(0, [1], 10, tokens=[1]), Request(1, [1], 30, tokens=[1]), Request(2, [1], 50, tokens=[1]),
                Request.filler(3)]  # tokens: as prefilled
    requests[0].extend([5] * 4)
    requests[1].extend([5] * 12)
    requests[2].extend([5] * 50)  # done
    assert Tail.of(requests) == Tail(2, 18) and Tail.of([requests[2]]) == Tail(0, 0)
    assert tail_tokens_per_step(2.5, 1.0, Tail.of([requests[2]])) == 2.5


def test_a_static_batchs_tail_can_make_greedy_win():
    """Mean tokens per unit cost favour k = 4 by 5 %; in a static batch of 16 with 128 tokens left
    the slowest request's extra steps cost more than that: greedy. One request: k = 4 still."""
    chooser = KChooser(4)
    for _ in range(300):
        chooser.record_accepts(ACCEPT_LENGTHS, 4)
    for rows in (1, 16):
        time_all(chooser, rows, {0: 1.0, 1: 10.0, 2: 10.0, 3: 10.0, 4: chooser.expected_tokens(4) / 1.05})
    assert chooser.choose(16) == 4  # a batcher: no tail
    assert chooser.choose(16, Tail(16, 128)) == 0
    assert chooser.choose(1, Tail(1, 128)) == 4
    assert chooser.choose(16, Tail(16, 10 ** 6)) == 4  # a long way left: the spread is small beside it


def test_a_calls_steps_calibrate_its_ks_tail():
    """The model's tail is a pooled rate's; a call of k = 4 that took 30% more steps than it
    said makes k = 4's tail that much longer at that row bucket (running mean over calls), and
    the choice moves to k = 3. Mixed calls, batches of one and k = 0 calls calibrate nothing."""
    chooser = KChooser(4)
    for _ in range(300):
        chooser.record_accepts(ACCEPT_LENGTHS, 4)
    tail = Tail(16, 127)
    tokens = [chooser.batch_tokens(k, tail) for k in range(5)]  # the model's, tail included
    time_all(chooser, 16, {0: 2.0, 1: 10.0, 2: 10.0, 3: tokens[3] / 1.0, 4: tokens[4] / 1.04})  # k=4 4% ahead
    assert chooser.choose(16, tail) == 4
    model_steps = 127 / chooser.batch_tokens(4, tail)
    chooser.record_call(16, [0, 0, 0, 1, round(1.3 * model_steps)], tail)  # k = 4 ran every step but one
    assert 127 / chooser.batch_tokens(4, tail, 16) == pytest.approx(1.3 * model_steps, rel=0.03)
    assert chooser.batch_tokens(4, tail, 4) == chooser.batch_tokens(4, tail)  # another bucket: the model's
    assert chooser.choose(16, tail) == 4  # mid-call: 2% ahead does not pay SWITCH_STEPS
    assert chooser.choose(16, tail, fresh=True) == 3  # a call's first step: k = 3 (1.225 in between) 2% ahead
    assert chooser._tail_factors[16] == pytest.approx([1.0, 1.075, 1.15, 1.225, 1.3], rel=0.03)
    before = dict(chooser._tail_factor)
    chooser.record_call(16, [20, 0, 0, 0, 30], tail)  # k = 4 on 60% of the steps: mixed
    chooser.record_call(1, [0, 0, 0, 0, 30], Tail(1, 127))  # one request: no tail
    chooser.record_call(16, [127], tail)  # greedy
    assert chooser._tail_factor == before
    chooser.record_call(16, [0, 0, 0, 0, round(model_steps)], tail)  # a call as the model said
    assert chooser._tail_factor[(16, 4)] == pytest.approx((1.3 + 1.0) / 2, rel=0.03)
    assert chooser.snapshot()["tail_factor"] == {16: {4: round(chooser._tail_factor[(16, 4)], 3)}}


def test_generate_calls_calibrate_the_tail_and_batchers_do_not(models):
    session = ortspec.Session(models.converted("base"), num_speculative_tokens="auto")
    for fixed_rows in (False, True):  # only the live rows run, or every row
        session.k_chooser = ScriptedK(4, [2])
        session.generate(PROMPTS, max_new_tokens=24, fixed_rows=fixed_rows)
        assert list(session.k_chooser._tail_factor) == [(row_bucket(len(PROMPTS)), 2)]
    session.k_chooser = ScriptedK(4, [2])
    with session.batcher(max_batch_size=3) as batcher:  # requests join: no tail, nothing recorded
        for prompt in PROMPTS:
            batcher.add_request(prompt, max_new_tokens=24)
        while batcher.pending:
            batcher.step()
    assert not session.k_chooser._tail_factor


class TailSpy(ScriptedK):
    def __init__(self, max_k, script) -> None:
        super().__init__(max_k, script)
        self.tails = []

    def choose(self, rows: int, tail: Tail | None = None, fresh: bool = False) -> int:
        self.tails.append(tail)
        return super().choose(rows, tail, fresh)


@pytest.mark.parametrize("pipelined", [False, True])
def test_generate_calls_tell_the_chooser_their_tail_and_batchers_do_not(models, pipelined):
    session = ortspec.Session(models.converted("base"), num_speculative_tokens="auto")
    session.k_chooser = spy = TailSpy(4, [0, 0, 0, 2, 0, 0, 3])
    for fixed_rows in (False, True):  # only the live rows run (the CPU's way), or every row
        session.generate(PROMPTS, max_new_tokens=30, fixed_rows=fixed_rows, pipelined=pipelined and fixed_rows)
        tails = spy.tails[1:]  # the first: the Decoder's, before the prefill
        assert tails and all(t is not None for t in tails)
        assert tails[0] == Tail(3, 29) and all(t.live <= 3 and t.tokens_left <= 29 for t in tails)
        assert [t.tokens_left for t in tails] == sorted((t.tokens_left for t in tails), reverse=True)
        spy.tails.clear()
    with session.batcher(max_batch_size=3) as batcher:
        for prompt in PROMPTS:
            batcher.add_request(prompt, max_new_tokens=30)
        while batcher.pending:
            batcher.step()
    assert spy.tails and all(t is None for t in spy.tails)


class TimeSpy(ScriptedK):
    def __init__(self, max_k, script) -> None:
        super().__init__(max_k, script)
        self.timed, self.chosen = [], []

    def choose(self, rows: int, tail=None, fresh: bool = False) -> int:
        self.chosen.append(super().choose(rows, tail, fresh))
        return self.chosen[-1]

    def record_time(self, rows, k, seconds):
        self.timed.append((k, seconds))


def test_only_steady_steps_are_timed(models, monkeypatch):
    """A step between two k's (on CUDA the head then runs in a Run of its own; a k = 0 stretch
    ends with a catch-up) or one that set a CUDA graph up (counted by GraphSlots.setup_runs)
    costs more than a run of its k: only the steps inside a run of one k are timed."""
    import time

    from ortspec.runtime.model import MTPHead
    from ortspec.speculative.decoder import Decoder
    from ortspec.speculative.exactness import make_requests
    from ortspec.speculative.stats import Stats

    graphs = GraphSet(ortspec.Session(models.converted("base")).manifest)
    original, graphed_runs = MTPHead.catch_up, []

    def slow_setup(self, rows, hidden, next_ids, positions, last, drafts, graphed=True):
        if not graphed:  # the deferred catch-up (and the prefill's): make it stand out
            time.sleep(0.25)
        else:
            graphed_runs.append(1)
            if len(graphed_runs) % 7 == 0:
                graphs.slots.setup_runs += 1  # as if this run had captured a graph
        return original(self, rows, hidden, next_ids, positions, last, drafts, graphed)

    monkeypatch.setattr(MTPHead, "catch_up", slow_setup)
    spy = TimeSpy(3, [2] * 5 + [0] * 5 + [3] * 4 + [1])
    stats = Stats()
    Decoder(graphs, 2, 3, "select", stats, k_chooser=spy, fused_verify=False).generate(make_requests(PROMPTS[:2], 40))
    steady = sum(a == b == c for a, b, c in zip(spy.chosen, spy.chosen[1:], spy.chosen[2:]))
    assert spy.timed and len(spy.timed) < steady < stats.steps  # < steady: some steady steps set a graph up
    assert {k for k, _ in spy.timed} >= {0, 2, 3} and 1 not in {k for k, _ in spy.timed}  # a run of one is never steady
    assert max(seconds for _, seconds in spy.timed) < 0.25  # the switching catch-ups left out


# -- exactness under any choice ------------------------------------------------------------------

@pytest.mark.parametrize("commit", ["select", "readvance"])
def test_any_sequence_of_k_is_exact(models, commit):
    """Scripted k sequences with runs of k = 0 (the head's entries deferred, then caught up in
    one run), batch of 3, scripted drafts: tokens equal greedy and, after every commit, the
    target's states equal the plain decode's bitwise, and the head's too whenever no entries wait."""
    graphs = GraphSet(ortspec.Session(models.converted("base")).manifest)
    reference = plain_decode_states(graphs, PROMPTS, 60 + 4 + 1, 4)
    for script in ([0, 0, 0, 2, 0, 3, 1, 0, 0, 4], [3, 0, 2, 0, 0, 0, 0, 1]):
        chooser = ScriptedK(4, script)
        stats = check_speculative(graphs, PROMPTS, 60, 4, commit, p=0.7, seed=3, reference=reference,
                                  k_chooser=chooser)
        assert stats.steps_by_k[0] > 5 and sum(stats.steps_by_k[1:]) > 5, stats.steps_by_k


def test_fixed_rows_with_auto_k_is_exact(models):
    graphs = GraphSet(ortspec.Session(models.converted("mixed")).manifest)
    check_speculative(graphs, PROMPTS, 40, 3, "select", p=0.8, seed=1, fixed_rows=True,
                      k_chooser=ScriptedK(3, [0, 0, 2, 0, 0, 0, 3, 1]))


def test_a_skipped_deferred_catch_up_is_caught(models, monkeypatch):
    """The check is not vacuous: drop the entries that k = 0 steps left and the head's state differs."""
    from ortspec.speculative.deferred_entries import DeferredEntries

    graphs = GraphSet(ortspec.Session(models.converted("base")).manifest)
    original = DeferredEntries.add_host
    monkeypatch.setattr(DeferredEntries, "add_host", lambda self, requests, rows, hidden, dtype, ids, positions: (
        original(self, requests, rows, hidden, dtype, ids, positions + 1)))  # entries written one slot too far
    with pytest.raises(ExactnessError, match="MTP state"):
        check_speculative(graphs, PROMPTS, 30, 2, "select", p=0.7, k_chooser=ScriptedK(2, [0, 0, 2]))


def test_auto_session_equals_greedy_and_reports_its_choices(models):
    out = models.converted("base")
    greedy = ortspec.Session(out).generate(PROMPTS, max_new_tokens=40)
    session = ortspec.Session(out, num_speculative_tokens="auto")
    assert session.k == 4
    for _ in range(3):
        assert session.generate(PROMPTS, max_new_tokens=40) == greedy
        assert session.generate(PROMPTS[1], max_new_tokens=40) == greedy[1]
    stats = session.stats
    assert sum(stats["steps_by_k"]) == stats["steps"] and len(stats["steps_by_k"]) == 5
    assert all(stats["steps_by_k"]), stats["steps_by_k"]  # every k was tried
    auto = stats["auto_k"]
    assert len(auto["acceptance_by_depth"]) == 4 and auto["expected_tokens"][0] == 1.0
    assert set(auto["step_ms"]) >= {1, 4} and set(auto["step_ms"][1]) == {0, 1, 2, 3, 4}


def test_auto_batcher_with_arrivals_equals_greedy(models):
    """Requests join a running batch while k = 0 steps have left the head's entries waiting:
    the prefill catches the others up first."""
    out = models.converted("base")
    greedy = ortspec.Session(out).generate(PROMPTS, max_new_tokens=30)
    session = ortspec.Session(out, num_speculative_tokens="auto")
    session.k_chooser = ScriptedK(4, [0, 0, 0, 0, 0, 2, 0, 0])
    with session.batcher(max_batch_size=3) as batcher:
        ids = [batcher.add_request(PROMPTS[0], max_new_tokens=30)]
        for prompt in PROMPTS[1:]:
            batcher.step()
            batcher.step()
            ids.append(batcher.add_request(prompt, max_new_tokens=30))
        while batcher.pending:
            batcher.step()
        assert [batcher.result(i) for i in ids] == greedy


def test_auto_sampling_runs_and_exact_mode_chooses_up_to_exact_k(models):
    out = models.converted("base")
    session = ortspec.Session(out, num_speculative_tokens="auto")
    tokens = session.generate(PROMPTS[0], max_new_tokens=20, temperature=0.8, seed=1)
    assert len(tokens) == 20
    exact = ortspec.Session(out, num_speculative_tokens="auto", exact=True, exact_batch_size=2, exact_k=2)
    assert exact.k == 2
    assert exact.generate(PROMPTS, max_new_tokens=20) == ortspec.Session(out).generate(PROMPTS, max_new_tokens=20)


def test_auto_option_errors(models, tmp_path):
    with pytest.raises(ortspec.ConfigurationError, match="not a count"):
        ortspec.Session(models.converted("base"), num_speculative_tokens="fast")
    from tools.make_tiny_checkpoint import make_checkpoint

    make_checkpoint(tmp_path / "ck", seed=4, mtp=False)
    out = ortspec.convert(tmp_path / "ck", tmp_path / "out", max_length=64, progress=False)
    with pytest.raises(ortspec.ConfigurationError, match="cannot speculate: its checkpoint has no mtp"):
        ortspec.Session(out, num_speculative_tokens="auto")
    assert ortspec.Session(out).generate([1, 2, 3], max_new_tokens=4)


def test_acceptance_counts_match_their_definition_per_row():
    """record_accepts keeps per depth, decayed: tried = rows whose accept length a reached draft i
    (i <= min(a + 1, k)), kept = rows with a >= i; checked against that definition row by row."""
    from ortspec.speculative.auto_k import HALF_LIFE_ROW_STEPS, PRIOR_ROW_STEPS

    rng = np.random.default_rng(5)
    chooser, tried, kept = KChooser(4), np.zeros(5), np.zeros(5)
    for _ in range(40):
        k = int(rng.integers(1, 5))
        accepted = rng.integers(0, k + 1, size=int(rng.integers(1, 6)))
        chooser.record_accepts(accepted, k)
        depth = np.arange(5)
        decay = 0.5 ** (len(accepted) / HALF_LIFE_ROW_STEPS)
        tried = tried * decay + ((depth >= 1) & (depth[None] <= np.minimum(accepted + 1, k)[:, None])).sum(0)
        kept = kept * decay + ((depth >= 1) & (depth[None] <= accepted[:, None])).sum(0)
    want = ((kept + 0.5 * PRIOR_ROW_STEPS) / (tried + PRIOR_ROW_STEPS))[1:]
    np.testing.assert_allclose(chooser.acceptance(), want, rtol=1e-12)
    beyond = np.concatenate([[1.0], np.cumprod(want)])
    np.testing.assert_allclose([chooser.expected_tokens(k) for k in range(5)], np.cumsum(beyond), rtol=1e-12)


def test_a_change_of_k_must_pay_for_itself_over_the_steps_left():
    """Leaving the last step's k costs SWITCH_STEPS steps (a drained pipeline, a two-Run step):
    a gain of a few percent is not worth it near a static batch's end, a large one is."""
    chooser = KChooser(2)
    for _ in range(8):
        chooser.record_accepts(np.array([2, 2, 1, 2]), 2)  # E(1) ~ 1.9, E(2) ~ 2.6
    run_steps(chooser, 1, 3 * auto_k.RUN_STEPS, lambda k: 0.01)  # every k timed at 10 ms
    expected = [chooser.expected_tokens(k) for k in range(3)]

    def settle(k_cost: dict, tail) -> int:
        """The k chosen after the chooser last ran k = 1, when the costs are k_cost."""
        for k, cost in k_cost.items():
            for _ in range(auto_k.WINDOW):
                chooser.record_time(1, k, cost)
        chooser._current[1] = 1
        chooser._steps[1] = 1  # no probe slot next
        return chooser.choose(1, tail)

    near = {0: 1.0, 1: 0.010, 2: 0.010 * expected[2] / expected[1] / 1.02}  # k = 2 gains 2% per step
    assert settle(near, Tail(1, 40)) == 1  # ~21 steps left: 0.4 steps gained < SWITCH_STEPS
    assert settle(near, None) == 2  # a batcher's horizon, PROBE_EVERY steps: 5 steps gained
    far = {0: 1.0, 1: 0.010, 2: 0.010 * expected[2] / expected[1] / 1.5}  # k = 2 gains 50%
    assert settle(far, Tail(1, 40)) == 2


def test_the_end_of_a_trial_goes_to_the_best_k_not_the_k_tried():
    """A trial's k is not what the chooser keeps: once every k is timed it goes to the best even
    where the best is only a little better than the last k tried (on the H200 a chooser that kept
    the last trial's k = 4 ran every later step at k = 4, 0.86x greedy at batch 16)."""
    chooser = KChooser(4)
    for _ in range(8):
        chooser.record_accepts(np.array([1, 1, 2, 0]), 4)
    costs = {0: 0.010, 1: 0.0125, 2: 0.0150, 3: 0.0175}
    best = max(chooser.batch_tokens(k, Tail(4, 30)) / costs[k] for k in costs)
    costs[4] = chooser.batch_tokens(4, Tail(4, 30)) / (0.98 * best)  # k = 4 timed last, 2% behind the best
    chosen = run_steps(chooser, 4, 5 * auto_k.RUN_STEPS - 1, costs.get)
    assert chosen[-1] == 4  # the trials ended on k = 4
    rates = {k: chooser.batch_tokens(k, Tail(4, 30)) / costs[k] for k in costs}
    assert chooser.choose(4, Tail(4, 30)) == max(rates, key=rates.get) != 4
