"""Auto k's runs of one k >= 1 at depth 1 (the host a step ahead of the GPU): tokens equal greedy;
the states equal a plain decode's bitwise where each run ends (read out) and after every step not
run ahead; the chooser is asked once per step, as at depth 0, so a script of k runs the same steps
at both depths. Forced onto the CPU (pipelined=True, fixed rows), where every forward is bitwise
reproducible.

The tiny random models accept almost no MTP draft, so every draft the head makes is scripted
(``script_drafts``): its own catch-up's and the fused graph's alike, as a pure function of the row
and the first position of the step the drafts are for. The plain decode the states are compared
with runs under the same script, so it holds the same next drafts at every length."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import ortspec
from ortspec.manifest import graph_name
from ortspec.runtime.fused_run import FusedRun
from ortspec.runtime.graphs import GraphSet
from ortspec.runtime.model import MTPHead
from ortspec.speculative.auto_k import ScriptedK
from ortspec.speculative.decoder import Decoder
from ortspec.speculative.drafts import MTPDrafts, ScriptedDrafts
from ortspec.speculative.exactness import ExactnessError, check_speculative, make_requests, plain_decode_states
from ortspec.speculative.stats import Stats
from ortspec.speculative.step_kinds import FusedSteps
from tests.test_auto_k import TimeSpy
from tests.test_auto_pipelined import count_calls

PROMPTS = [[5, 17, 99, 3, 250, 7, 11], [42], [8, 8, 8, 300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
NEW_TOKENS = 60
K = 4  # the most drafts (the converted models' num_speculative_tokens)
SEED = 5  # the draft script's
# k per step (cycled): runs of 2, 3 and 1 of several lengths, single steps of another k, k = 0 stretches
SCRIPTS = ([2] * 6 + [3] * 4 + [0, 0, 1, 1, 1, 3, 2, 0, 2, 2, 1], [3, 3, 3, 1, 1, 1, 1, 0, 0, 0, 2, 2, 2, 2, 3, 2, 1])


def script_drafts(monkeypatch, graphs, oracle: dict) -> None:
    """Every draft the MTP head makes, scripted: for the step of row r whose first position is P,
    right (oracle[r][P+1..]) for m positions, m drawn from 0..K by (SEED, r, P), then wrong (the
    right token + 1). The head's own catch-up (MTPHead.catch_up: prefill, decode steps, two-Run
    steps, deferred catch-ups) and the fused graphs (verify_mtp_k{k}, over rows 0..B-1: fixed rows)."""
    vocab = graphs.manifest.spec.vocab_size

    def drafts_for(row: int, first: int, n: int) -> np.ndarray:  # [n]
        truth = np.array((oracle.get(row, [])[first + 1: first + 1 + n] + [0] * n)[:n], np.int64)
        right = np.arange(n) < np.random.default_rng([SEED, row, first]).integers(0, K + 1)
        return np.where(right, truth, (truth + 1) % vocab)

    catch_up = MTPHead.catch_up

    def scripted_catch_up(self, rows, hidden, next_ids, positions, last, drafts, graphed=True):
        catch_up(self, rows, hidden, next_ids, positions, last, drafts, graphed)
        firsts = np.asarray(positions)[np.arange(len(last)), last] + 1  # [B]: the next step's first positions
        return np.stack([drafts_for(int(r), int(p), drafts) for r, p in zip(rows.indices, firsts)])

    monkeypatch.setattr(MTPHead, "catch_up", scripted_catch_up)
    for k in range(1, K + 1):
        runner = graphs[graph_name("verify_mtp", k)]
        monkeypatch.setattr(runner, "run", _scripted_fused_run(runner.run, k, drafts_for))


def _scripted_fused_run(run, k: int, drafts_for):
    """verify_mtp_k{k}'s run with its drafts (step_ids' last k columns, and ``drafts``) scripted."""
    def run_scripted(feeds, slot=None, wait=True):
        out = dict(run(feeds, slot, wait))
        step_ids = np.array(out["step_ids"])  # [B, 2k+2]
        firsts = np.asarray(feeds["positions"])[:, 0] + step_ids[:, k + 1] + 1  # [B]: T + a + 1
        step_ids[:, k + 2:] = np.stack([drafts_for(j, int(p), k) for j, p in enumerate(firsts)])
        out["step_ids"], out["drafts"] = step_ids, step_ids[:, k + 2:].copy()
        return out

    return run_scripted


def greedy_tokens(graphs, prompts, n: int) -> dict:
    """{row: prompt + n greedy tokens}: the script's truth (greedy tokens do not depend on drafts)."""
    requests = make_requests(prompts, n)
    Decoder(graphs, len(prompts), 0, "select", Stats()).generate(requests)
    return {r.row: r.tokens for r in requests}


def scripted_reference(graphs, prompts, n: int):
    """(the script's oracle, plain_decode_states over n tokens run under the script)."""
    oracle = greedy_tokens(graphs, prompts, n)
    with pytest.MonkeyPatch.context() as patch:
        script_drafts(patch, graphs, oracle)
        reference = plain_decode_states(graphs, prompts, n, K)
    assert reference[0] == oracle
    return oracle, reference


@pytest.fixture(scope="module")
def graphs(models):
    return GraphSet(ortspec.Session(models.converted("base")).manifest)


@pytest.fixture(scope="module")
def scripted(graphs):
    return scripted_reference(graphs, PROMPTS, NEW_TOKENS + K + 1)


@pytest.fixture
def oracle(graphs, scripted, monkeypatch):
    """The script in place for this test; its oracle."""
    script_drafts(monkeypatch, graphs, scripted[0])
    return scripted[0]


def record_hand_overs(monkeypatch) -> list:
    """The chooser's answers a run handed to the step after it (asked for the step it would have
    enqueued ahead, which then ran from the host), in order."""
    handed, ahead = [], Decoder._plan_ahead

    def recorded(self, flight):
        planned = ahead(self, flight)
        if planned is None and self._pipe.chosen is not None:
            handed.append(self._pipe.chosen)
        return planned

    monkeypatch.setattr(Decoder, "_plan_ahead", recorded)
    return handed


def check(graphs, scripted, script, new_tokens: int = NEW_TOKENS, **options) -> Stats:
    """check_speculative over PROMPTS with the script's k, pipelined, the head's own (scripted) drafts."""
    return check_speculative(graphs, PROMPTS, new_tokens, K, "select", reference=scripted[1], fixed_rows=True,
                             pipelined=True, k_chooser=ScriptedK(K, script), make_drafts=MTPDrafts, **options)


@pytest.mark.parametrize("script", SCRIPTS)
def test_runs_of_one_k_run_pipelined_and_stay_exact(graphs, scripted, oracle, monkeypatch, script):
    """Tokens equal greedy; states checked after every step not run ahead and where every run ends;
    most speculative steps pipelined; each change of k hands the chooser's answer to the next step."""
    handed = record_hand_overs(monkeypatch)
    stats = check(graphs, scripted, script)
    assert stats.pipelined_speculative_steps > stats.speculative_steps / 2, stats
    assert stats.steps_by_k[0] > 0 and all(stats.steps_by_k[1:4]), stats.steps_by_k
    assert min(stats.accept_histogram[:3]) > 0 and stats.position_mismatches == 0, stats.accept_histogram
    assert len(handed) >= 3 and 0 in handed and len(set(handed)) > 1, handed


def test_a_stop_token_and_budgets_inside_runs(graphs, scripted, oracle, monkeypatch):
    """Requests 2 and 0 end by the stop token, at different steps of a run of k = 2; request 1 goes
    on, its states checked where the run hands over to k = 3, and ends by its budget inside the run
    of k = 3: tokens as greedy, at most one step run past the last end."""
    stop = next(t for i, t in enumerate(oracle[0][len(PROMPTS[0]):]) if i >= 15 and t not in oracle[0][:i])
    steps = count_calls(monkeypatch, "enqueue", FusedRun)
    # 8 x 2: the call's first choice (made with its tail once its prompts are in) and 7 more
    stats = check(graphs, scripted, [2] * 8 + [3] * 8, new_tokens=30, stop_tokens=[stop])
    assert stats.steps_by_k[2:] == [8, 3] and stats.pipelined_speculative_steps >= 8, stats.steps_by_k
    assert steps[0] - stats.pipelined_speculative_steps in (0, 1)  # at most one step past the last request's end


def test_near_max_length_the_plain_loop_finishes(graphs, monkeypatch):
    """A request that fills max_length: runs of k = 3 stop running ahead while T + 2k + 1 still
    fits, and the host plans the last steps (speculative, then decode steps where k no longer fits)."""
    long = list(np.arange(200) % 300 + 1)
    prompts, budget = [long, PROMPTS[1]], graphs.manifest.max_length - len(long)
    oracle, reference = scripted_reference(graphs, prompts, budget)
    script_drafts(monkeypatch, graphs, oracle)
    stats = check_speculative(graphs, prompts, budget, K, "select", reference=reference, fixed_rows=True,
                              pipelined=True, k_chooser=ScriptedK(K, [3] * 9 + [2]), make_drafts=MTPDrafts)
    assert 0 < stats.pipelined_speculative_steps < stats.speculative_steps and stats.decode_steps > 0, stats


def test_next_drafts_left_stale_at_a_run_end_are_caught(graphs, scripted, oracle, monkeypatch):
    """Planted: the host keeps no next drafts from the fused steps (the device needs none from it
    while it runs ahead). Tokens stay greedy's (any drafts verify), but where a run ends the
    head's drafts are not the plain decode's: the check at each run end catches it."""
    read = FusedSteps.read

    def drafts_kept_on_the_device_only(self, n):
        result = read(self, n)
        result.next_drafts = None
        return result

    monkeypatch.setattr(FusedSteps, "read", drafts_kept_on_the_device_only)
    with pytest.raises(ExactnessError, match="next drafts"):
        check(graphs, scripted, SCRIPTS[0])


@dataclasses.dataclass
class StepKs(Stats):
    """Stats that also keep the k of every step, in order."""

    ks: list = dataclasses.field(default_factory=list)

    def record_decode_step(self) -> None:
        super().record_decode_step()
        self.ks.append(0)

    def record_speculative_step(self, accepted, k: int, fused: bool = False) -> None:
        super().record_speculative_step(accepted, k, fused)
        self.ks.append(k)


def steps_run(graphs, script, pipelined: bool) -> tuple[list, StepKs]:
    stats = StepKs()
    decoder = Decoder(graphs, len(PROMPTS), K, "select", stats, fixed_rows=True, pipelined=pipelined,
                      k_chooser=ScriptedK(K, script))
    return decoder.generate(make_requests(PROMPTS, 40)), stats


def ask_twice_at_a_hand_over(monkeypatch) -> None:
    """Planted: the step after a run asks the chooser again instead of taking the run's answer."""
    plan = Decoder._plan

    def asking_again(self):
        self._pipe.chosen = None
        return plan(self)

    monkeypatch.setattr(Decoder, "_plan", asking_again)


def run_on_past_a_change(monkeypatch) -> None:
    """Planted: the run asks the chooser but enqueues the next step of its k whatever it chose."""
    ahead = Decoder._plan_ahead

    def running_on(self, flight):
        planned = ahead(self, flight)
        if planned is None and self._pipe.chosen is not None and flight.plan.k:
            self._pipe.chosen = None
            return flight.plan, flight.run.requests
        return planned

    monkeypatch.setattr(Decoder, "_plan_ahead", running_on)


@pytest.mark.parametrize("planted", [None, ask_twice_at_a_hand_over, run_on_past_a_change])
def test_the_chooser_is_asked_once_per_step(graphs, oracle, monkeypatch, planted):
    """The same script runs the same k at every step at both depths (depth 1 asks before enqueueing
    step n+1 what depth 0 asks when it plans it), with the same accept lengths; a hand-over that
    asks twice, or a run that runs on past a change, shifts the steps' k."""
    plain, plain_stats = steps_run(graphs, SCRIPTS[1], pipelined=False)
    if planted:
        planted(monkeypatch)
    piped, piped_stats = steps_run(graphs, SCRIPTS[1], pipelined=True)
    assert piped == plain and piped_stats.pipelined_speculative_steps > 5 and plain_stats.pipelined_steps == 0
    same = piped_stats.ks == plain_stats.ks and piped_stats.accept_histogram == plain_stats.accept_histogram
    assert same == (planted is None), (piped_stats.ks, plain_stats.ks)


def test_pipelined_steps_give_the_chooser_their_time_and_accept_lengths(graphs, oracle, monkeypatch):
    """record_time for k >= 1 from fused steps (all but each run's step 0), record_accepts from
    every speculative step, run ahead or not."""
    class Spy(TimeSpy):
        def __init__(self, max_k, script) -> None:
            super().__init__(max_k, script)
            self.accepts = []

        def record_accepts(self, accepted, k):
            self.accepts.append((len(accepted), k))

    spy = Spy(K, [2] * 7 + [3] * 7)
    decoder = Decoder(graphs, len(PROMPTS), K, "select", Stats(), fixed_rows=True, pipelined=True, k_chooser=spy)
    runs = count_calls(monkeypatch, "__init__", FusedRun)  # the runs that ran a step
    decoder.generate(make_requests(PROMPTS, 40))
    stats = decoder.stats
    assert {k for k, _ in spy.timed} == {2, 3} and runs[0] >= 3
    assert len(spy.timed) == stats.fused_verify_steps - runs[0]  # no graph set up on the CPU
    assert len(spy.accepts) == stats.speculative_steps and {k for _, k in spy.accepts} == {2, 3}


def test_where_auto_runs_speculative_steps_ahead(graphs):
    def decoder(**options):
        return Decoder(graphs, 3, K, options.pop("commit", "select"), Stats(), fixed_rows=True, pipelined=True,
                       k_chooser=ScriptedK(K, [2]), **options)

    assert decoder().kinds.fused_ks == frozenset(range(1, K + 1))
    assert decoder(on_commit=lambda d, batch: None).depth == 1  # the hook is called where nothing is in flight
    for options in (dict(commit="readvance"), dict(fused_verify=False)):
        assert decoder(**options).kinds.fused_ks == frozenset(), options
    scripted = decoder(make_drafts=lambda mtp: ScriptedDrafts(MTPDrafts(mtp), lambda r: [], 300))
    scripted.generate(make_requests(PROMPTS, 12))
    assert scripted.stats.pipelined_speculative_steps == 0 < scripted.stats.fused_verify_steps  # proposed from the host
