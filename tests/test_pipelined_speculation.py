"""The loop at depth 1 over fused speculative steps (the host a step ahead of the GPU, k >= 1, one
Run per step) is the loop at depth 0, bit for bit: same tokens and acceptance, and each request's
states at its end equal a plain one-token-at-a-time decode's. Depth 1 is the CUDA default; here
it is forced onto the CPU (pipelined=True, fixed rows), where every forward is bitwise reproducible.

The tiny random models accept almost no MTP draft, so most tests script the fused graph's drafts
(``scripted_drafts``): its step_ids and drafts outputs are replaced, row by row, by drafts right
for a scripted number of positions. Both loops then verify the same drafts, and the device-side
control (next inputs made from step_ids) is driven through every accept length."""

from __future__ import annotations

import numpy as np
import pytest

import ortspec
from ortspec import InternalError
from ortspec.runtime.arrays import HostArrays
from ortspec.runtime.fused_run import FusedRun
from ortspec.runtime.graphs import GraphSet
from ortspec.speculative.decoder import Decoder
from ortspec.speculative.drafts import MTPDrafts, ScriptedDrafts
from ortspec.speculative.exactness import plain_decode_states
from ortspec.speculative.requests import Request
from ortspec.speculative.stats import Stats
from tests.test_auto_k import ScriptedK
from tests.test_pipelined import stand_in_static_inputs
from tools.gpu_suite.spec_loop import differences, request_end_states

PROMPTS = [[5, 17, 99, 3, 250, 7, 11], [42], [8, 8, 8, 300, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
LONGEST = 40  # new tokens the plain decode reference covers (plus k + 1)


@pytest.fixture(scope="module")
def graphs(models):
    return GraphSet(ortspec.Session(models.converted("base")).manifest)


@pytest.fixture(scope="module")
def reference(graphs):
    """({row: prompt + greedy tokens}, {(row, length): RowState}) of a plain decode, per k."""
    return {k: plain_decode_states(graphs, PROMPTS, LONGEST + k + 1, k) for k in (2, 3)}


def scripted_drafts(monkeypatch, graphs, k: int, oracle: dict, seed: int = 0, graph: str | None = None) -> None:
    """The fused graph's next drafts for row j are right for m positions, m drawn from 0..k by
    (seed, j, the row's next first position), then wrong (truth + 1): both loops see the same.
    graph: the fused graph's name (default verify_mtp_k{k}; a KV window variant, verify_mtp_k{k}.w256)."""
    runner = graphs[graph or f"verify_mtp_k{k}"]
    run, vocab = runner.run, graphs.manifest.spec.vocab_size

    def run_scripted(feeds, slot=None, wait=True):
        out = dict(run(feeds, slot, wait))
        step_ids = np.array(out["step_ids"])  # [B, 2k+2]
        for j, first in enumerate(np.asarray(feeds["positions"])[:, 0] + step_ids[:, k + 1] + 1):
            truth = (oracle[j][first + 1: first + 1 + k] + [0] * k)[:k] if j in oracle else [0] * k
            right = np.arange(k) < np.random.default_rng([seed, j, int(first)]).integers(0, k + 1)
            step_ids[j, k + 2:] = np.where(right, truth, (np.array(truth) + 1) % vocab)
        out["step_ids"], out["drafts"] = step_ids, step_ids[:, k + 2:].copy()
        return out

    monkeypatch.setattr(runner, "run", run_scripted)


def decode(graphs, specs, k: int, pipelined: bool, **options) -> tuple[list[list[int]], Decoder]:
    """Speculative greedy over (prompt, max_new_tokens, stop tokens) in rows 0.., all rows every step."""
    requests = [Request(row=i, prompt=list(p), max_new_tokens=n, stop_tokens=frozenset(stops))
                for i, (p, n, stops) in enumerate(specs)]
    decoder = Decoder(graphs, len(requests), k, "select", Stats(), fixed_rows=True, pipelined=pipelined, **options)
    assert decoder.depth == pipelined
    return decoder.generate(requests), decoder


def from_plain_decode(table: dict):
    """wanted(row, length) for ``spec_loop.differences``: the plain decode's target and MTP states."""
    return lambda row, length: (table[(row, length)].target, table[(row, length)].mtp)


@pytest.mark.parametrize("k", [2, 3])
def test_tokens_acceptance_and_states_equal_the_plain_loop(graphs, reference, monkeypatch, k):
    oracle, table = reference[k]
    scripted_drafts(monkeypatch, graphs, k, oracle, seed=k)
    specs = [(p, LONGEST, ()) for p in PROMPTS]
    plain, plain_decoder = decode(graphs, specs, k, pipelined=False)
    with request_end_states() as ends:
        piped, piped_decoder = decode(graphs, specs, k, pipelined=True)
    assert piped == plain == [oracle[j][len(p): len(p) + LONGEST] for j, p in enumerate(PROMPTS)]
    a, b = plain_decoder.stats, piped_decoder.stats
    assert b.pipelined_speculative_steps == b.speculative_steps == a.speculative_steps == a.fused_verify_steps
    assert b.accept_histogram == a.accept_histogram and min(a.accept_histogram) > 0, a.accept_histogram
    assert sorted(ends) == [0, 1, 2] and differences(ends, from_plain_decode(table)) == []
    final = max(n for _, _, n, _ in ends.values())
    for req, (target, _), n, _ in ends.values():  # ended by the last step read: as the plain loop left them (a
        if n == final:                         # step run past the end may have changed them since: never read)
            theirs = plain_decoder.target.states.row_state(req.row, req.processed)
            assert all(np.array_equal(target[name][tuple(slice(0, s) for s in value.shape)], value)
                       for name, value in theirs.items())


def test_budgets_and_a_stop_token(graphs, reference, monkeypatch):
    """A request done at its prefill, short and long budgets, a stop token: tokens as the plain loop,
    at most one step run past the end (its tokens dropped, not counted)."""
    oracle, table = reference[2]
    scripted_drafts(monkeypatch, graphs, 2, oracle, seed=7)
    stop = oracle[0][len(PROMPTS[0]) + 12]
    specs = [(PROMPTS[0], 30, (stop,)), (PROMPTS[1], 1, ()), (PROMPTS[2], 9, ())]
    plain, plain_decoder = decode(graphs, specs, 2, pipelined=False)
    assert plain[0][-1] == stop and len(plain[1]) == 1 and len(plain[2]) == 9
    calls = [0]
    step = FusedRun.enqueue
    monkeypatch.setattr(FusedRun, "enqueue", lambda self, *a, **kw: (calls.__setitem__(0, calls[0] + 1), step(self, *a, **kw))[1])
    piped, piped_decoder = decode(graphs, specs, 2, pipelined=True)
    assert piped == plain
    steps = plain_decoder.stats.speculative_steps
    assert piped_decoder.stats.speculative_steps == steps and calls[0] in (steps, steps + 1)
    assert piped_decoder.stats.generated_tokens == plain_decoder.stats.generated_tokens


def test_near_max_length_the_plain_loop_finishes(models, monkeypatch):
    """A request that fills max_length: the loop stops running ahead while T + 2k + 1 still fits and
    plans the last steps from the host (speculative steps, then decode steps for the last positions)."""
    graphs = GraphSet(ortspec.Session(models.converted("base")).manifest)
    long = list(np.arange(200) % 300 + 1)
    budget = graphs.manifest.max_length - len(long)
    oracle, table = plain_decode_states(graphs, [long, PROMPTS[1]], budget, 3)
    scripted_drafts(monkeypatch, graphs, 3, oracle, seed=1)
    specs = [(long, budget, ()), (PROMPTS[1], 20, ())]
    plain, plain_decoder = decode(graphs, specs, 3, pipelined=False)
    with request_end_states() as ends:
        piped, piped_decoder = decode(graphs, specs, 3, pipelined=True)
    assert piped == plain and len(piped[0]) == budget
    stats = piped_decoder.stats
    assert 0 < stats.pipelined_speculative_steps < stats.speculative_steps and stats.decode_steps > 0
    assert stats.accept_histogram == plain_decoder.stats.accept_histogram
    assert 1 in ends and differences({1: ends[1]}, from_plain_decode(table)) == []


def test_the_captured_slot_path_equals_the_plain_loop(graphs, reference, monkeypatch):
    """FusedRun's CUDA path (the next inputs written into a captured slot's static buffers, the
    commit reading them) on the CPU over a stand-in slot table that loads each run's host inputs
    into the static buffers, as CapturedSlot.load_inputs does."""
    oracle, _ = reference[3]
    scripted_drafts(monkeypatch, graphs, 3, oracle, seed=4)
    specs = [(p, 25, ()) for p in PROMPTS]
    plain, _ = decode(graphs, specs, 3, pipelined=False)
    statics = stand_in_static_inputs(monkeypatch, graphs, "verify_mtp_k3")
    piped, _ = decode(graphs, specs, 3, pipelined=True)
    assert statics and piped == plain


def test_next_positions_off_by_one_are_caught(graphs, reference, monkeypatch):
    """Planted: the kernel starts the next step one position late. The accept lengths still agree
    (the graph and the host judge the same tokens), so the state comparison must catch it."""
    oracle, table = reference[2]
    scripted_drafts(monkeypatch, graphs, 2, oracle, seed=2)
    advance = HostArrays.advance_speculative_inputs

    def one_late(self, step_ids, ids, positions, verified, counts, last_start):
        advance(self, step_ids, ids, positions, verified, counts, last_start)
        positions += 1

    monkeypatch.setattr(HostArrays, "advance_speculative_inputs", one_late)
    with request_end_states() as ends:
        decode(graphs, [(p, 12, ()) for p in PROMPTS], 2, pipelined=True)
    assert differences(ends, from_plain_decode(table))


def test_a_wrong_accept_length_is_an_internal_error_and_the_session_goes_on(models, monkeypatch):
    """Planted: the graph's accept length one past the greedy rule's. The host's check, a step late,
    raises InternalError; the next call (a prefill resets the rows) generates the greedy tokens."""
    session = ortspec.Session(models.converted("base"), num_speculative_tokens=2)
    greedy = ortspec.Session(models.converted("base")).generate(PROMPTS, max_new_tokens=10)
    runner = session.graphs["verify_mtp_k2"]
    run = runner.run

    def one_too_many(feeds, slot=None, wait=True):
        out = dict(run(feeds, slot, wait))
        out["step_ids"] = np.array(out["step_ids"])
        out["step_ids"][:, 3] = np.minimum(out["step_ids"][:, 3] + 1, 2)
        return out

    monkeypatch.setattr(runner, "run", one_too_many)
    with pytest.raises(InternalError, match=r"verify_mtp_k2 accepted .* where the greedy rule accepts"):
        session.generate(PROMPTS, max_new_tokens=10, fixed_rows=True, pipelined=True)
    monkeypatch.setattr(runner, "run", run)
    assert session.generate(PROMPTS, max_new_tokens=10, fixed_rows=True, pipelined=True) == greedy
    assert session.stats["pipelined_speculative_steps"] > 0


def test_where_no_speculative_step_runs_ahead(models, graphs):
    prompts = [list(p) for p in PROMPTS]

    def ahead_steps(k=2, **options):
        options.setdefault("fixed_rows", True)
        options.setdefault("pipelined", True)
        stats = Stats()
        decoder = Decoder(graphs, 3, k, options.pop("commit", "select"), stats, **options)
        decoder.generate([Request(row=i, prompt=p, max_new_tokens=12) for i, p in enumerate(prompts)])
        return stats.pipelined_speculative_steps, stats.speculative_steps

    ahead, steps = ahead_steps()
    assert 0 < ahead == steps
    assert ahead_steps(k=0) == (0, 0)  # greedy: test_pipelined.py
    assert ahead_steps(k_chooser=ScriptedK(2, [2]))[0] > 0  # auto: its runs of one k >= 1
    for options in (dict(commit="readvance"), dict(fused_verify=False), dict(pipelined=False),
                    dict(pipelined=None),  # the CPU default
                    dict(make_drafts=lambda mtp: ScriptedDrafts(MTPDrafts(mtp), lambda r: [], 300))):
        ahead, steps = ahead_steps(**options)
        assert ahead == 0 < steps, options
    session = ortspec.Session(models.converted("base"), num_speculative_tokens=2)
    sampled = dict(max_new_tokens=8, temperature=0.8, seed=3, fixed_rows=True)  # accepted and drafted on the device
    assert session.generate(PROMPTS, **sampled, pipelined=True) == session.generate(PROMPTS, **sampled)
    assert session.stats["pipelined_speculative_steps"] > 0


def test_the_host_twin_of_the_kernel_equals_the_native_one():
    """HostArrays.advance_speculative_inputs (numpy) computes what the native kernel does."""
    native = pytest.importorskip("ortspec._native")
    rng = np.random.default_rng(0)
    k, B = 3, 5
    step_ids = rng.integers(0, 300, (B, 2 * k + 2))
    step_ids[:, k + 1] = [0, 1, 2, 3, 3]
    positions = np.array([[t + j for j in range(k + 1)] for t in (0, 10, 60, 100, 252)], np.int64)
    results = []
    for run in (HostArrays().advance_speculative_inputs,
                lambda *a: native.advance_speculative_inputs(*a)):
        ids, pos, verified, counts = np.zeros((B, k + 1), np.int64), positions.copy(), np.zeros_like(positions), \
            np.zeros(B, np.int64)
        run(step_ids, ids, pos, verified, counts, 252)
        results.append((ids, pos, verified, counts))
    for mine, theirs in zip(*results):
        np.testing.assert_array_equal(mine, theirs)
    ids, pos, verified, counts = results[0]
    assert ids[1].tolist() == [step_ids[1, 1], *step_ids[1, k + 2:]] and pos[1].tolist() == [12, 13, 14, 15]
    assert pos[4].tolist() == [252, 253, 254, 255] and counts.tolist() == [1, 2, 3, 4, 4]  # parked at last_start
    assert np.array_equal(verified, positions)
    step_ids[2, k + 1] = k + 1
    with pytest.raises(ValueError, match=r"accept length\) = 4 is out of range 0..k=3; nothing was written"):
        native.advance_speculative_inputs(step_ids, ids, pos, verified, counts, 252)
