"""Auto k's stretches of k = 0 steps at depth 1 (the host a step ahead of the GPU): tokens equal
greedy and, after every speculative commit and after every catch-up that ends a stretch, the
states equal a plain decode's bitwise. Depth 1 is the CUDA default; here it is forced onto the
CPU (pipelined=True, fixed rows), where every forward is bitwise reproducible, so any difference
is the loop's."""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import numpy as np
import pytest

import ortspec
from ortspec.runtime.decode_run import DecodeRun
from ortspec.runtime.graphs import GraphSet
from ortspec.speculative import decoder as decoder_module
from ortspec.speculative.auto_k import KChooser, ScriptedK
from ortspec.speculative.decoder import Decoder, Plan, StepClock
from ortspec.speculative.exactness import ExactnessError, check_speculative, make_requests, plain_decode_states
from ortspec.speculative.head import Head
from ortspec.speculative.stats import Stats
from tests.test_auto_k import TimeSpy

PROMPTS = [[5, 17, 99, 3, 250, 7, 11], [42], [8, 8, 8, 300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
NEW_TOKENS = 50
HOOK = lambda decoder, batch: None  # noqa: E731  (an on_commit hook)
LONG_STRETCHES = ([0] * 9 + [2] + [0] * 6 + [3, 1], [4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0])


@pytest.fixture(scope="module")
def graphs(models):
    return GraphSet(ortspec.Session(models.converted("base")).manifest)


@pytest.fixture(scope="module")
def reference(graphs):
    return plain_decode_states(graphs, PROMPTS, NEW_TOKENS + 4 + 1, 4)


def count_calls(monkeypatch, name: str, cls=DecodeRun) -> list[int]:
    """Counts calls of cls.<name> (DecodeRun.enqueue: the forwards the loop enqueued)."""
    calls, original = [0], getattr(cls, name)

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, counted)
    return calls


def check_catch_ups(monkeypatch) -> list[int]:
    """Counts the catch-ups over waiting entries (one ends each stretch)."""
    calls, original = [0], Head.catch_up_deferred

    def counted(self, drafts):
        calls[0] += 1
        return original(self, drafts)

    monkeypatch.setattr(Head, "catch_up_deferred", counted)
    return calls


@pytest.mark.parametrize("commit", ["select", "readvance"])
def test_long_k0_stretches_run_pipelined_and_stay_exact(graphs, reference, monkeypatch, commit):
    """Scripted k with stretches of up to 12 k = 0 steps, batch of 3: every k = 0 step runs in the
    pipelined loop, and the states are checked after each speculative commit and each catch-up."""
    for script in LONG_STRETCHES:
        catch_ups, hidden_reads = check_catch_ups(monkeypatch), count_calls(monkeypatch, "_start_hidden")
        stats = check_speculative(graphs, PROMPTS, NEW_TOKENS, 4, commit, p=0.7, seed=3, reference=reference,
                                  fixed_rows=True, pipelined=True, k_chooser=ScriptedK(4, script))
        assert stats.pipelined_steps == stats.steps_by_k[0] > 20, stats.steps_by_k
        assert sum(stats.steps_by_k[1:]) >= 3 and catch_ups[0] >= 3, (stats.steps_by_k, catch_ups)
        assert hidden_reads[0] == stats.pipelined_steps  # one hidden readback per stretch step
        monkeypatch.undo()


def first_new_token(tokens: list[int], start: int) -> int:
    """The first token at or after output index `start` that the output has not had before."""
    return next(t for i, t in enumerate(tokens) if i >= start and t not in tokens[:i])


def test_a_stop_token_inside_a_stretch(models, graphs, reference, monkeypatch):
    """Request 0 stops inside a stretch while the others run on: its row runs one step past its
    end (dropped), and its state is no longer read; the others' are checked at later catch-ups."""
    stop = first_new_token(reference[0][0][len(PROMPTS[0]):], 12)
    script = [2] + [0] * 40  # one speculative step, then k = 0 to the end: the stop falls in a stretch
    stats = check_speculative(graphs, PROMPTS, NEW_TOKENS, 4, "select", p=0.7, reference=reference,
                              fixed_rows=True, pipelined=True, k_chooser=ScriptedK(4, script), stop_tokens=[stop])
    assert stats.pipelined_steps > 20
    greedy = ortspec.Session(models.converted("base")).generate(PROMPTS[0], max_new_tokens=NEW_TOKENS,
                                                                stop_tokens=[stop])
    assert greedy[-1] == stop and len(greedy) < NEW_TOKENS
    session = ortspec.Session(models.converted("base"), num_speculative_tokens="auto")
    session.k_chooser = ScriptedK(4, [0])
    steps = count_calls(monkeypatch, "enqueue")
    assert session.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS, stop_tokens=[stop], fixed_rows=True,
                            pipelined=True) == greedy
    assert steps[0] == session.stats["pipelined_steps"] + 1  # the step past the stop, run a step ahead


def test_a_budget_ending_inside_a_stretch_runs_no_extra_step(graphs, reference, monkeypatch):
    steps = count_calls(monkeypatch, "enqueue")
    stats = check_speculative(graphs, PROMPTS, 30, 4, "select", p=0.7, reference=reference, fixed_rows=True,
                              pipelined=True, k_chooser=ScriptedK(4, [3, 0, 0, 0, 0, 0, 0, 0, 0, 0]))
    assert stats.steps_by_k[0] > 10
    assert steps[0] == stats.pipelined_steps  # no step past the budgets: it ended inside a stretch


def test_hidden_rows_read_one_step_late_are_caught(graphs, reference, monkeypatch):
    """The state check is not vacuous: the head's entries from the hidden rows of the step before
    (a pipelining bug that reads the wrong readback) leave the MTP head's state wrong."""
    original, history = DecodeRun.read, []

    def one_step_late(self, n):
        tokens, hidden = original(self, n)
        history.append(hidden)
        return tokens, history[-2] if len(history) > 1 else history[-1]

    monkeypatch.setattr(DecodeRun, "read", one_step_late)
    with pytest.raises(ExactnessError, match="MTP state"):
        check_speculative(graphs, PROMPTS, 30, 4, "select", p=0.7, reference=reference, fixed_rows=True,
                          pipelined=True, k_chooser=ScriptedK(4, [0, 0, 0, 0, 2]))


def test_stretch_positions_feed_the_accept_length_check(graphs, reference, monkeypatch):
    """A stretch step records where it ran (Request.last_first_position): forget it and the next
    speculative step's accept length from positions disagrees (counted, then raised)."""
    record = Decoder._record

    def record_forgetting_positions(self, flight, result):
        kept = {id(r): (r.last_first_position, r.last_accepted) for r in flight.run.requests}
        record(self, flight, result)
        if flight.run.plan.k == 0:
            for r in flight.run.requests:
                r.last_first_position, r.last_accepted = kept[id(r)]

    monkeypatch.setattr(Decoder, "_record", record_forgetting_positions)
    with pytest.raises(ExactnessError, match="position mismatches"):
        check_speculative(graphs, PROMPTS, 30, 4, "select", p=0.7, reference=reference, fixed_rows=True,
                          pipelined=True, k_chooser=ScriptedK(4, [0, 0, 0, 2]))


def run_stretch(graphs, chooser, new_tokens: int, consumer_seconds: float = 0.0) -> Decoder:
    decoder = Decoder(graphs, len(PROMPTS), 4, "select", Stats(), fixed_rows=True, pipelined=True, k_chooser=chooser)
    for _ in decoder.steps(make_requests(PROMPTS, new_tokens)):
        time.sleep(consumer_seconds)
    return decoder


def test_stretch_steps_are_timed_as_the_interval_between_token_reads(graphs, monkeypatch):
    """One stretch of k = 0 to the end: every step but the first is timed (its interval holds
    the pipeline's fill), and not the time the caller spends between steps."""
    spy = TimeSpy(4, [0])
    decoder = run_stretch(graphs, spy, 12, consumer_seconds=0.08)
    steps = decoder.stats.pipelined_steps
    assert steps == 11 and decoder.stats.speculative_steps == 0
    assert [k for k, _ in spy.timed] == [0] * (steps - 1)
    assert statistics.median(seconds for _, seconds in spy.timed) < 0.08  # the caller's sleeps left out


def test_stretch_steps_around_a_graph_setup_are_not_timed(graphs, monkeypatch):
    """A first run or capture (GraphSlots.setup_runs) waits for the GPU, which then has no step
    queued: both intervals it touches are left out (here: setups planted at steps 0 and 5)."""
    original = DecodeRun.enqueue

    def planted_setups(self, n, *args, **kwargs):
        if n in (0, 5):
            self.graphs.slots.setup_runs += 1
        return original(self, n, *args, **kwargs)

    monkeypatch.setattr(DecodeRun, "enqueue", planted_setups)
    spy = TimeSpy(4, [0])
    decoder = run_stretch(graphs, spy, 12)
    # intervals 1..10 timed but 1 (after step 0's setup), 4 and 5 (step 5 enqueued in interval 4)
    assert len(spy.timed) == decoder.stats.pipelined_steps - 1 - 3


def test_step_clock_times_steady_intervals_only(monkeypatch):
    """A fake clock: step 0 untimed, the caller's time between calls left out, and both intervals
    that touch a CUDA graph setup left out."""
    now = [0.0]
    monkeypatch.setattr(decoder_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    graphs = SimpleNamespace(slots=SimpleNamespace(setup_runs=0))
    clock, plan, timed = StepClock(graphs, depth=1), Plan(object, 2, 2, (0, 1, 2)), []
    clock.start_run()
    for n, (seconds, caller, setup) in enumerate([(1.0, 5, 0), (0.5, 0, 0), (0.25, 7, 0), (0.125, 0, 1),
                                                  (2.0, 0, 0), (0.75, 0, 0)]):
        with clock.inside():
            now[0] += seconds
            graphs.slots.setup_runs += setup
            timed.append(clock.read(n, plan))
        now[0] += caller
    assert [seconds for _, seconds, _ in timed] == [None, 0.5, 0.25, None, None, 0.75]
    assert [elapsed for elapsed, _, _ in timed] == [0.0, 0.5, 0.25, 0.125, 2.0, 0.75]  # every step's time, for windows
    assert [setup for _, _, setup in timed] == [False, False, False, True, False, False]
    assert clock.read(6, Plan(object, 2, 3, (0, 1, 2)))[1] is None  # the next step's k differs: not steady


def test_the_real_chooser_times_k0_from_stretches_and_equals_greedy(models, monkeypatch):
    from ortspec.speculative import auto_k

    monkeypatch.setattr(auto_k.Arms, "START", 0)  # the climb from k = 0: its only neighbour k = 1 comes next
    out = models.converted("base")
    greedy = ortspec.Session(out).generate(PROMPTS, max_new_tokens=40)
    session = ortspec.Session(out, num_speculative_tokens="auto")
    for _ in range(3):  # a warm-up call at k = 0, then k = 0 measured, then k = 1
        assert session.generate(PROMPTS, max_new_tokens=40, fixed_rows=True, pipelined=True) == greedy
    streamed = session.generate(PROMPTS[2], max_new_tokens=40, stream=True, fixed_rows=True, pipelined=True)
    assert list(streamed) == greedy[2]
    stats = session.stats
    assert 0 < stats["pipelined_steps"] <= stats["steps_by_k"][0] and sum(stats["steps_by_k"][1:]) > 0
    assert 0 in stats["auto_k"]["step_ms"][4]  # k = 0's cost at 3 rows (bucket 4): measured in stretches
    assert stats["pipelined_speculative_steps"] > 0  # calls of k >= 1: runs of fused steps ahead
    assert any(k >= 1 for k in stats["auto_k"]["step_ms"][4])  # timed there


def test_sampled_requests_run_ahead_with_auto_k(models):
    """Sampled rows draw on the device, at k = 0 and k >= 1 alike: their stretches and runs go ahead,
    and the tokens are those of depth 0 with the same seed."""
    session = ortspec.Session(models.converted("base"), num_speculative_tokens="auto")
    sampled = dict(max_new_tokens=24, temperature=0.8, seed=3, fixed_rows=True)
    runs = []
    for pipelined in (True, False):
        session.k_chooser = ScriptedK(4, [0, 0, 0, 2, 2, 2, 2])
        session.reset_stats()
        runs.append(session.generate(PROMPTS, **sampled, pipelined=pipelined))
        if pipelined:
            assert session.stats["pipelined_steps"] > 0 and session.stats["pipelined_speculative_steps"] > 0
    assert runs[0] == runs[1] and len(runs[0][0]) == 24


def test_a_plain_greedy_decoder_reads_no_hidden_rows(graphs, monkeypatch):
    """k = 0 Sessions have no head to catch up: their loop reads back tokens only, as before."""
    monkeypatch.setattr(DecodeRun, "_start_hidden", lambda self, n, h: pytest.fail("a greedy loop read hidden rows"))
    decoder = Decoder(graphs, len(PROMPTS), 0, "select", Stats(), fixed_rows=True, pipelined=True)
    requests = make_requests(PROMPTS, 10)
    assert decoder.depth == 1 and decoder.generate(requests)
    assert decoder.head is None and decoder.stats.pipelined_steps == 9


@pytest.mark.parametrize("k,chooser,on_commit", [(0, None, None), (2, None, None), (4, KChooser(4), None),
                                                  (4, KChooser(4), HOOK), (0, None, HOOK)])
def test_the_depth_is_chosen_once_whatever_the_k_and_hook(monkeypatch, graphs, k, chooser, on_commit):
    """On CUDA (a stand-in arrays object: the decoder is only built) every decoder runs at depth 1,
    greedy, fixed k or auto, with or without a hook (called where nothing is in flight); exact
    mode at depth 0."""
    from ortspec.runtime.forward_shapes import ExactShape

    monkeypatch.setattr(graphs, "arrays", SimpleNamespace(device="cuda", shared_stream=True))
    engine = SimpleNamespace(target=SimpleNamespace(graphs=graphs), mtp=None)
    options = dict(engine=engine, k_chooser=chooser, on_commit=on_commit)
    assert Decoder(graphs, 3, k, "select", Stats(), **options).depth == 1
    assert Decoder(graphs, 4, k, "select", Stats(), exact=ExactShape(4, 4), **options).depth == 0


def test_stretch_entries_equal_the_plain_loops(graphs):
    """The entries a stretch leaves (hidden rows read back a step late) are the plain loop's bit
    for bit: same hidden rows, tokens and positions per row."""
    taken = []
    for pipelined in (False, True):
        decoder = Decoder(graphs, len(PROMPTS), 4, "select", Stats(), fixed_rows=True, pipelined=pipelined,
                          k_chooser=ScriptedK(4, [0]))
        decoder.generate(make_requests(PROMPTS, 9))
        [run] = decoder.head.deferred.take()  # one run: every row took part in every step
        taken.append(run)
    (_, rows_a, *plain), (_, rows_b, *piped) = taken
    assert rows_a.indices.tolist() == rows_b.indices.tolist()
    for a, b in zip(plain, piped):
        np.testing.assert_array_equal(a, b)


def test_deferred_entries_gather_each_rows_steps_and_refuse_rows_out_of_step():
    """Entries are kept per step and gathered per row at the catch-up: a row that left the steps
    (the CPU drops finished rows) is dropped; a row whose request joined mid-stretch (drop_rows)
    has its entries from its join on, padded past its last with that last; a row of the latest
    step missing from an earlier step of its request is a bug, said so."""
    from ortspec.errors import InternalError
    from ortspec.runtime.arrays import HostArrays
    from ortspec.runtime.states import Rows
    from ortspec.speculative.deferred_entries import DeferredEntries

    def step(entries, at, rows):
        hidden = np.array([[10 * row + at] * 3 for row in rows], np.float32)  # [b, H=3]
        entries.add_host(["r"] * len(rows), Rows(rows), hidden, np.float32, np.array(rows) + 100, np.array(rows) + at)

    entries = DeferredEntries(HostArrays())
    for at, rows in enumerate(([0, 1, 2], [0, 2], [0, 2])):
        step(entries, at, rows)
    [(requests, rows, hidden, next_ids, positions, last)] = entries.take()
    assert rows.indices.tolist() == [0, 2] and not entries and last.tolist() == [2, 2]
    assert hidden[:, :, 0].tolist() == [[0, 1, 2], [20, 21, 22]]  # [B, m]
    assert next_ids.tolist() == [[100] * 3, [102] * 3] and positions.tolist() == [[0, 1, 2], [2, 3, 4]]

    for pad_lengths, runs in ((True, 1), (False, 2)):
        entries = DeferredEntries(HostArrays(), pad_lengths=pad_lengths)
        step(entries, 0, [0, 1])
        entries.drop_rows(Rows([1]))  # a new request takes row 1 over
        step(entries, 1, [0, 1])
        step(entries, 2, [0, 1])
        taken = entries.take()
        assert len(taken) == runs
        last = np.concatenate([run[5] for run in taken])
        hidden = [run[2][j, :, 0].tolist() for run in taken for j in range(len(run[1].indices))]
        positions = [run[4][j].tolist() for run in taken for j in range(len(run[1].indices))]
        assert last.tolist() == [2, 1]
        assert hidden[0] == [0, 1, 2] and hidden[1][:2] == [11, 12] and positions[1][:2] == [2, 3]
        if pad_lengths:
            assert hidden[1] == [11, 12, 12] and positions[1] == [2, 3, 3]  # padding: its last entry again

    step(entries, 0, [0, 1, 2])
    entries.drop_rows(Rows([1]))  # taken over after the latest step: its request has no step entries yet
    runs = entries.take()
    assert [run[1].indices.tolist() for run in runs] == [[0], [2]]  # ranges of rows, each side of it
    assert [run[5].tolist() for run in runs] == [[0], [0]]

    for rows in ([0, 1], [0, 3]):
        entries.add_host(["r"], Rows(rows), np.zeros((2, 3), np.float32), np.float32, np.zeros(2), np.zeros(2))
    with pytest.raises(InternalError, match="out of step: row 3 of the latest step missed an earlier step of its request"):
        entries.take()