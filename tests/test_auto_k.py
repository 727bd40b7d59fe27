"""num_speculative_tokens="auto": how the chooser decides (windows of steps, hill climbing over k
on measured tokens per second), and that any sequence of k it chooses (k = 0 steps leaving the
MTP head's entries for later included) is exact."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import ortspec
from ortspec.runtime.graphs import GraphSet
from ortspec.speculative import auto_k
from ortspec.speculative.auto_k import KChooser, ScriptedK, Tail, row_bucket
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
    expected = chooser.snapshot()["expected_tokens"]
    assert expected[0] == 1.0 and expected[2] == pytest.approx(1 + 2 / 3 + 1 / 3, abs=0.02)


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


def batcher_windows(chooser: KChooser, rows: int, windows: int, tokens_per_second, live=None, seed=0,
                    step_seconds: float = 1e-3) -> list[int]:
    """Steps as a batcher's loop runs them, window after window (steps short enough that none
    closes on WINDOW_SECONDS): each step's k chosen before it, then its tokens and seconds recorded
    (tokens_per_second(k) per live row, in units of 1 / step_seconds, with 2% noise; live(window)
    the live rows). Returns the k of each window."""
    rng, chosen, opened = np.random.default_rng(seed), [], None
    while True:
        k = chooser.choose(rows)
        if chooser.open_window is not opened:  # the last window closes as the next opens
            if len(chosen) == windows:
                return chosen
            opened = chooser.open_window
            chosen.append(k)
        n = live(len(chosen) - 1) if live else rows
        chooser.record_step(rows, n, n * 4, step_seconds * 4 / tokens_per_second(k) * rng.uniform(0.98, 1.02))


def test_slow_steps_end_a_window_early_so_a_short_run_still_climbs():
    """A CPU step over 8 rows takes 7-20 ms: windows of WINDOW_SECONDS, not WINDOW_STEPS steps,
    so the climb has measured every k and stands on the best within a few seconds of steps."""
    chooser = KChooser(2)
    chooser.warmed_up()
    rates = {0: 1170.0, 1: 1087.0, 2: 1190.0}  # tokens/s at 8 rows (k = 1 the worst, and where the climb starts)
    rng, ks, seconds = np.random.default_rng(0), [], 0.0
    while seconds < 3.0:
        k = chooser.choose(8)
        step = {0: 0.0068, 1: 0.0143, 2: 0.0174}[k]
        chooser.record_step(8, 8, round(rates[k] * step), step * rng.uniform(0.98, 1.02))
        ks.append(k)
        seconds += step
    windows = chooser.snapshot()["windows"]["batcher rows 8"]
    assert windows["windows"] >= 10  # 64-step windows: 3 s held three of them, the climb's first steps alone
    assert windows["best"] == 2 and windows["reward"][1][1] >= 1
    assert ks[-len(ks) // 3:].count(1) <= len(ks) // 12  # k = 1 left behind but for a probe


def test_the_climb_finds_the_best_k_and_tries_few_others():
    rates = {0: 100.0, 1: 150.0, 2: 190.0, 3: 210.0, 4: 180.0}
    chooser = KChooser(4)
    chosen = batcher_windows(chooser, 4, 60, rates.get)
    assert chosen[:8] == [1, 1, 2, 2, 3, 3, 4, 4]  # each k's first window warms up; from k = 1 up the neighbours
    assert chosen[-20:].count(3) >= 18  # then the best, a neighbour again every PROBE_EVERY windows
    assert chooser.snapshot()["windows"]["batcher rows 4"]["best"] == 3


def test_after_a_warm_up_each_ks_first_window_counts():
    """A server's warm-up ran every k's graphs: its climb measures from the first window on
    instead of warming each k up again (the climb above spends a window per k on that)."""
    chooser = KChooser(2)
    chooser.warmed_up()
    chosen = batcher_windows(chooser, 4, 6, {0: 100.0, 1: 150.0, 2: 190.0}.get)
    assert chosen[:3] == [1, 2, 2]
    assert chooser.snapshot()["windows"]["batcher rows 4"]["reward"][1][1] == 1


def test_a_warm_up_of_one_row_leaves_other_rows_first_windows_uncounted():
    """The CPU's warm-up runs one row: at 8 rows each k's first window still runs its shapes'
    first runs (slower), so it warms up and is not counted; at 1 row it counts."""
    chooser = KChooser(2)
    chooser.warmed_up({1})
    rates = {0: 100.0, 1: 150.0, 2: 190.0}.get
    batcher_windows(chooser, 1, 1, rates)
    batcher_windows(chooser, 8, 1, rates)
    windows = chooser.snapshot()["windows"]
    assert windows["batcher rows 1"]["reward"][1][1] == 1 and windows["batcher rows 8"]["reward"] == {}


def test_a_ks_first_window_at_a_key_only_warms_it_up_and_is_short():
    """Its steps run the graphs' first runs and measure nothing: MIN_WINDOW_STEPS of them, then
    the same k's first measured window, of WINDOW_STEPS."""
    chooser, lengths, opened = KChooser(2), [], None
    while len(lengths) < 3:
        k = chooser.choose(4)
        if chooser.open_window is not opened:
            opened = chooser.open_window
            lengths.append([k, 0])
        lengths[-1][1] += 1
        chooser.record_step(4, 4, 8, 1e-3)
    assert lengths[:2] == [[1, auto_k.MIN_WINDOW_STEPS], [1, auto_k.WINDOW_STEPS]] and lengths[2][0] == 2


def test_a_k_within_the_hysteresis_does_not_take_the_best_place():
    chooser = KChooser(2)
    chosen = batcher_windows(chooser, 1, 30, {0: 100.0, 1: 200.0, 2: 201.0}.get)  # k = 2 0.5% better
    assert chosen[-10:] == [1] * 10


def test_the_climb_follows_a_change():
    """The text got less predictable: k = 3's reward falls, and its neighbour takes over."""
    chooser = KChooser(4)
    batcher_windows(chooser, 2, 30, {0: 100.0, 1: 150.0, 2: 190.0, 3: 210.0, 4: 180.0}.get)
    chosen = batcher_windows(chooser, 2, 40, {0: 100.0, 1: 150.0, 2: 190.0, 3: 120.0, 4: 100.0}.get, seed=1)
    assert chosen[-10:].count(2) >= 9


def test_a_batchers_windows_are_judged_per_live_row():
    """Live rows come and go with arrivals, whatever k: a window of few live rows is not worse for it."""
    chooser = KChooser(2)
    rates = {0: 100.0, 1: 150.0, 2: 140.0}
    chosen = batcher_windows(chooser, 8, 40, rates.get, live=lambda w: 8 if w % 3 else 2)
    assert chosen[-10:].count(1) >= 9


def test_sampled_and_greedy_steps_climb_apart():
    """Sampled drafts are accepted less often: where most rows sample, another k may pay, so their
    windows have a key of their own and one kind of traffic does not steer the other's k."""
    chooser = KChooser(3)
    greedy = {0: 100.0, 1: 150.0, 2: 190.0, 3: 170.0}
    sampled = {0: 100.0, 1: 90.0, 2: 80.0, 3: 70.0}
    for w in range(40):
        for _ in range(auto_k.WINDOW_STEPS):
            k = chooser.choose(8, sampled=w % 2 == 1)
            chooser.record_step(8, 8, 32, 32e-3 / (sampled if w % 2 else greedy)[k])
    windows = chooser.snapshot()["windows"]
    assert windows["batcher rows 8"]["best"] == 2 and windows["batcher rows 8 sampled"]["best"] == 0


def test_a_cpu_batcher_files_its_windows_by_the_rows_it_runs(models):
    """On the CPU a step runs the running rows only, and what it costs depends on how many: one
    request in a batcher of four is timed under rows 1, not beside four rows' steps."""
    session = ortspec.Session(models.converted("base"), num_speculative_tokens="auto")
    with session.batcher(max_batch_size=4) as batcher:
        batcher.add_request(PROMPTS[0], max_new_tokens=40)
        while batcher.pending:
            batcher.step()
        batcher.add_request(PROMPTS[0], max_new_tokens=40, temperature=0.9, seed=1)
        while batcher.pending:
            batcher.step()
    assert set(session.stats["auto_k"]["windows"]) == {"batcher rows 1", "batcher rows 1 sampled"}


def test_a_calls_window_is_the_whole_call():
    """A static batch: the k chosen fresh at the call's start holds for every step of it (rows may
    leave), and the call's tokens per second judge it, tail and all."""
    chooser = KChooser(3)
    rates = {0: 100.0, 1: 95.0, 2: 90.0, 3: 80.0}  # a batch whose tail makes greedy win
    ks = []
    for call in range(12):
        k = chooser.choose(16, Tail(16, 64), fresh=True)
        for step in range(30):
            assert chooser.choose(16 if step < 20 else 3, Tail(16, 64 - step)) == k
            chooser.record_step(16, 16, 16, 16 / rates[k])
        chooser.record_call(16, [], Tail(16, 64))
        ks.append(k)
    # each k's first call warms up; k=1 came within 10% of greedy, so it is measured once more
    assert ks[:8] == [1, 1, 2, 2, 0, 0, 0, 1] and ks[-4:] == [0] * 4
    windows = chooser.snapshot()["windows"]
    assert windows["call rows 16"]["best"] == 0 and "batcher rows 16" not in windows


def test_a_short_call_measures_nothing():
    chooser = KChooser(2)
    chooser.choose(1, Tail(1, 2), fresh=True)
    chooser.record_step(1, 1, 1, 0.01)
    chooser.record_call(1, [], Tail(1, 2))
    assert chooser.snapshot()["windows"]["call rows 1"]["reward"] == {}


def test_each_threads_window_is_its_own():
    chooser, seen = KChooser(2), {}

    def call(name: str) -> None:
        seen[name] = chooser.choose(4, Tail(4, 10), fresh=True)
        for _ in range(10):
            assert chooser.choose(4, Tail(4, 9)) == seen[name]
            chooser.record_step(4, 4, 4, 0.01)
        chooser.record_call(4, [], Tail(4, 10))

    threads = [threading.Thread(target=call, args=(str(i),)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    window = chooser.snapshot()["windows"]["call rows 4"]
    assert len(seen) == 3 and window["windows"] == 3  # three windows, none mixed with another


def test_tail_of_a_generate_calls_requests():
    from ortspec.speculative.requests import Request

    requests = [Request(row=0, prompt=[1], max_new_tokens=10), Request(row=1, prompt=[1], max_new_tokens=30),
                Request.filler(2)]
    requests[0].tokens, requests[1].tokens = [1, 2, 3], [1, 2]
    assert Tail.of(requests) == Tail(2, 29)
    requests[1].cancel()
    assert Tail.of(requests) == Tail(1, 8)


def test_generate_calls_and_batchers_measure_their_own_windows(models):
    session = ortspec.Session(models.converted("base"), num_speculative_tokens="auto")
    for fixed_rows in (False, True):  # only the live rows run, or every row
        session.generate(PROMPTS, max_new_tokens=24, fixed_rows=fixed_rows)
    with session.batcher(max_batch_size=3) as batcher:  # requests join: windows of steps
        for _ in range(3):
            for prompt in PROMPTS:
                batcher.add_request(prompt, max_new_tokens=40)
            while batcher.pending:
                batcher.step()
    windows = session.stats["auto_k"]["windows"]
    assert sum(n for _, n in windows["call rows 4"]["reward"].values()) == 1  # the first warmed up
    assert windows["batcher rows 4"]["windows"] >= 2


class TailSpy(ScriptedK):
    def __init__(self, max_k, script) -> None:
        super().__init__(max_k, script)
        self.tails = []

    def choose(self, rows: int, tail: Tail | None = None, fresh: bool = False, sampled: bool = False) -> int:
        self.tails.append(tail)
        return super().choose(rows, tail, fresh)


@pytest.mark.parametrize("pipelined", [False, True])
def test_generate_calls_tell_the_chooser_their_tail_and_batchers_do_not(models, pipelined):
    session = ortspec.Session(models.converted("base"), num_speculative_tokens="auto")
    session.k_chooser = spy = TailSpy(4, [0, 0, 0, 2, 0, 0, 3])
    for fixed_rows in (False, True):  # only the live rows run (the CPU's way), or every row
        session.generate(PROMPTS, max_new_tokens=30, fixed_rows=fixed_rows, pipelined=pipelined and fixed_rows)
        tails = spy.tails
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

    def choose(self, rows: int, tail=None, fresh: bool = False, sampled: bool = False) -> int:
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
    assert sum(stats["steps_by_k"]) == stats["steps"] and stats["steps_by_k"][1] > 0, stats["steps_by_k"]
    assert sum(stats["steps_by_k"]) > stats["steps_by_k"][1]  # k = 1 first (a warm-up, then measured), then a neighbour
    auto = stats["auto_k"]
    assert len(auto["acceptance_by_depth"]) == 4 and auto["expected_tokens"][0] == 1.0
    assert set(auto["windows"]) == {"call rows 1", "call rows 4"}  # the first window of each warms up
    assert all(len(w["reward"]) >= 1 and w["best"] in range(5) for w in auto["windows"].values()), auto["windows"]


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
