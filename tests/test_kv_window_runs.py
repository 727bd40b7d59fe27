"""Which KV window variant the runtime runs (runtime/kv_window.py), and that the loops running
them give the tokens and states of the portable graph over all max_length slots, bit for bit.

CUDA runs the variants; here that choice is forced onto the CPU (``KVWindows.variants``) over
the portable graphs alone (the CPU variants left out: one formulation throughout, as on CUDA),
where a variant gives the portable graph's bits (tests/test_kv_windows.py). A window too narrow
for a row it serves changes that row's states (the planted bound below), so equal states mean
every running row's positions were inside its window."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import ortspec
from ortspec.manifest import Manifest
from ortspec.runtime.forward_shapes import ExactShape
from ortspec.runtime.graph_slots import SlotKey, is_captured_graph
from ortspec.runtime.graphs import GraphRunner, GraphSet
from ortspec.runtime.kv_window import KVWindows, RunBound
from ortspec.speculative.decoder import Decoder
from ortspec.speculative.exactness import check_speculative, plain_decode_states
from ortspec.speculative.requests import Request
from ortspec.speculative.stats import Stats
from tests import test_pipelined, test_pipelined_speculation
from tests.conftest import WINDOWED_K as K
from tests.conftest import WINDOWED_MAX_LENGTH as MAX_LENGTH
from tools.gpu_suite.spec_loop import differences, request_end_states

SHORT = [[42], [8, 8, 8, 300, 1, 2, 3, 4, 5, 6, 7, 8, 9]]


def prompt(n: int) -> list[int]:
    return list(np.arange(n) % 300 + 1)


def graph_set(model, variants: bool) -> GraphSet:
    manifest = Manifest.load(model)
    for entry in manifest.graphs.values():
        entry.pop("cpu", None)
    graphs = GraphSet(manifest)
    graphs.kv_windows.variants = variants
    return graphs


@pytest.fixture(scope="module")
def portable(windowed_model):
    return graph_set(windowed_model, variants=False)


@pytest.fixture(scope="module")
def narrowed(windowed_model):
    return graph_set(windowed_model, variants=True)


@pytest.fixture
def ran(monkeypatch) -> list[str]:
    """The names of the graphs run, in order (record before a test scripts a runner's outputs)."""
    names, run = [], GraphRunner.run

    def recorded(self, feeds, slot=None, wait=True):
        names.append(self.name)
        return run(self, feeds, slot, wait)

    monkeypatch.setattr(GraphRunner, "run", recorded)
    return names


@pytest.mark.parametrize("commit,fused,graphs_run", [
    ("select", True, {"verify_mtp_k3.w256", "verify_mtp_k3"}),
    ("readvance", False, {"verify_k3.w256", "verify_k3", "decode.w256", "mtp_propose_k3.w256", "mtp_propose_k3"})])
def test_the_plain_loop_picks_a_window_per_forward(portable, narrowed, ran, commit, fused, graphs_run):
    """Speculation (drafts right at p = 0.6) across the window's edge: the variant while every row
    fits in 256 slots, then the portable graph; the states after every commit bitwise a plain
    decode's over all max_length slots."""
    prompts = [prompt(230), *SHORT]
    reference = plain_decode_states(portable, prompts, 36 + K + 1, K)
    ran.clear()
    check_speculative(narrowed, prompts, 36, K, commit, p=0.6, reference=reference, fixed_rows=True,
                      fused_verify=fused)
    assert graphs_run <= set(ran), set(ran)


def greedy(graphs, budgets: list[int], pipelined: bool):
    """Greedy over a 217-token prompt, a short one, and a 290-token one done at its prefill (its
    row keeps running, past any window a run of the others gets)."""
    specs = [(prompt(217), budgets[0], ()), (SHORT[1], budgets[1], ()), (prompt(290), 1, ())]
    return test_pipelined.decode(graphs, specs, pipelined)


def test_a_greedy_run_fixes_the_window_its_bound_allows(portable, narrowed, ran):
    """Row 0 steps from 217 with 39 tokens left: its last step is at position 255, so the run fits
    in the first 256 slots, its last slot included. Tokens and row 0's states as the portable loop."""
    plain, plain_decoder = greedy(portable, [40, 30], pipelined=False)
    ran.clear()
    piped, piped_decoder = greedy(narrowed, [40, 30], pipelined=True)
    assert piped == plain and set(ran) == {"prefill", "decode.w256"}
    assert_same_states(piped_decoder, plain_decoder, row=0, length=217 + 39)


def test_a_bound_one_short_is_caught(portable, narrowed, ran, monkeypatch):
    """Planted: with one more token row 0's last step is at 256, past W = 256, so the run takes
    the portable graph; a bound one short takes the variant, and that step's states differ."""
    plain, plain_decoder = greedy(portable, [41, 30], pipelined=False)
    ran.clear()
    piped, piped_decoder = greedy(narrowed, [41, 30], pipelined=True)
    assert piped == plain and set(ran) == {"prefill", "decode"}
    assert_same_states(piped_decoder, plain_decoder, row=0, length=217 + 40)
    end = RunBound.end
    monkeypatch.setattr(RunBound, "end", lambda self, tokens, reach: end(self, tokens, reach) - 1)
    ran.clear()
    _, short_decoder = greedy(narrowed, [41, 30], pipelined=True)
    assert "decode.w256" in ran
    with pytest.raises(AssertionError):
        assert_same_states(short_decoder, plain_decoder, row=0, length=217 + 40)


def assert_same_states(mine: Decoder, theirs: Decoder, row: int, length: int) -> None:
    a, b = mine.target.states.row_state(row, length), theirs.target.states.row_state(row, length)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_a_speculative_run_fixes_the_window_with_the_heads_drafts(portable, narrowed, ran, monkeypatch):
    """k = 3, drafts right for a scripted number of positions: row 0 steps from 200 with 29 tokens
    left, so its steps and the head's drafts stay below 200 + 28 + 2k + 1 = 235: the run's one
    graph is the W = 256 variant. Tokens, acceptance and each request's states at its end as the
    plain loop over all max_length slots."""
    prompts = [prompt(200), SHORT[1], prompt(280)]
    oracle, table = plain_decode_states(portable, prompts, 30 + K + 1, K)
    test_pipelined_speculation.scripted_drafts(monkeypatch, portable, K, oracle, seed=5)
    test_pipelined_speculation.scripted_drafts(monkeypatch, narrowed, K, oracle, seed=5, graph="verify_mtp_k3.w256")
    specs = [(prompts[0], 30, ()), (prompts[1], 25, ()), (prompts[2], 1, ())]
    plain, plain_decoder = test_pipelined_speculation.decode(portable, specs, K, pipelined=False)
    ran.clear()
    with request_end_states() as ends:
        piped, piped_decoder = test_pipelined_speculation.decode(narrowed, specs, K, pipelined=True)
    assert piped == plain and piped_decoder.stats.accept_histogram == plain_decoder.stats.accept_histogram
    assert piped_decoder.stats.pipelined_speculative_steps > 0 and "verify_mtp_k3.w256" in ran
    assert "verify_mtp_k3" not in ran
    assert sorted(ends) == [0, 1] and differences(ends, test_pipelined_speculation.from_plain_decode(table)) == []


def test_exact_mode_runs_the_target_over_every_slot(portable, narrowed, ran):
    """Exact mode keeps one shape: its fixed verify never takes a variant (the head may)."""
    want = Decoder(portable, 1, 0, "select", Stats()).generate([Request(row=0, prompt=prompt(240), max_new_tokens=12)])
    ran.clear()
    exact = Decoder(narrowed, 1, K, "select", Stats(), exact=ExactShape(1, K))
    assert exact.generate([Request(row=0, prompt=prompt(240), max_new_tokens=12)]) == want
    assert "verify_select_k3" in ran and not any(name.startswith("verify_select_k3.w") for name in ran)


def test_a_cpu_session_never_loads_a_variant(windowed_model, ran):
    session = ortspec.Session(windowed_model, num_speculative_tokens=K)
    tokens = session.generate(prompt(240), max_new_tokens=20)
    assert tokens == ortspec.Session(windowed_model).generate(prompt(240), max_new_tokens=20)
    assert ran and not any(".w" in name for name in ran) and not session.graphs.kv_windows.variants


def test_the_smallest_bucket_past_the_positions_is_chosen(windowed_model):
    manifest = Manifest.load(windowed_model)
    manifest.graphs["decode"]["windows"]["128"] = manifest.graphs["decode"]["windows"]["256"]  # a second bucket
    windows = KVWindows(manifest, variants=True)
    assert [windows.graph("decode", end) for end in (1, 128, 129, 256, 257, MAX_LENGTH)] == \
        ["decode.w128", "decode.w128", "decode.w256", "decode.w256", "decode", "decode"]
    assert windows.graph("prefill", 5) == "prefill" and windows.graph("mtp_propose_k3", 30) == "mtp_propose_k3.w256"
    positions = np.array([[3, 4], [250, 251]])
    assert windows.for_positions("verify_k1", positions, reach=1) == "verify_k1.w256"  # slots 0..251
    assert windows.for_positions("verify_mtp_k3", positions, reach=6) == "verify_mtp_k3"  # 251 + 6 > 256
    assert not windows.views
    for entry in manifest.graphs.values():  # a model converted before variants: the portable graphs
        entry.pop("windows", None)
    assert windows.graph("decode", 1) == "decode"
    on_the_cpu = KVWindows(manifest, variants=False)
    assert on_the_cpu.views and on_the_cpu.graph("decode", 1) == "decode"


def test_variants_are_captured_graphs_of_their_own_slots():
    assert is_captured_graph("decode.w256") and is_captured_graph("verify_mtp_k3.w1024")
    assert not is_captured_graph("prefill")
    assert SlotKey("decode.w256", 1, 4, 0).describe() == "decode.w256/M1/B4/engine0"  # the counters' keys
def simulate_run(first: int, tokens_left: int, k: int, accepts) -> int:
    """The furthest slot a row's steps touch while it runs: a step from T writes T..T+k, and with
    k >= 1 the head's drafts sit at T + a + 1 .. T + a + k - 1 (a: that step's accept length);
    the step emits a + 1 tokens. Returns the largest position touched."""
    T, emitted, furthest = first, 0, -1
    for a in accepts:
        if emitted >= tokens_left:
            break
        furthest = max(furthest, T + k, T + a + k - 1)
        T, emitted = T + a + 1, emitted + a + 1
    return furthest


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4])
def test_a_runs_bound_holds_every_running_rows_positions_and_is_tight(k):
    """RunBound.end(k + 1, reach) is past every position a row's steps touch while it has tokens
    left (random accept lengths, budgets that end mid-step), and reached by some accept sequence:
    every draft rejected until the last step, which accepts all k."""
    reach = max(k, 1)
    rng = np.random.default_rng(k)
    for _ in range(200):
        first, left = int(rng.integers(0, 200)), int(rng.integers(1, 40))
        running = SimpleNamespace(processed=first, max_new_tokens=left + 3, output_length=3, done=False)
        finished = SimpleNamespace(processed=999, max_new_tokens=1, output_length=1, done=True)
        end = RunBound.of([running, finished]).end(k + 1, reach)
        assert simulate_run(first, left, k, rng.integers(0, k + 1, 100)) < end
        assert simulate_run(first, left, k, [0] * (left - 1) + [k]) == end - 1
    assert RunBound.of([]).end(1, 1) == 0


def test_device_buffers_are_never_viewed_even_with_variants_off(windowed_model):
    """tools/gpu.py kv_windows turns a CUDA Session's variants off to run the portable graphs:
    its caches are device buffers, which cannot be sliced into views (a TypeError on the H200)."""
    manifest = Manifest.load(windowed_model)
    on_cuda = KVWindows(manifest, variants=True, host_buffers=False)
    on_cuda.variants = False
    assert not on_cuda.views
    assert KVWindows(manifest, variants=False).views  # the CPU's host arrays
