"""Exact mode (Session(exact=True)): every post-prefill target forward runs at one fixed shape.

On the CPU the bits of a token never depended on the shape, so here exact mode must give
exactly the default mode's tokens and states (the same code path the GPU runs, exercised in
CI). What makes it exact on a GPU is the shape discipline itself, which the CPU's bits cannot
show: a spy on the graph runners checks that after prefill the target ran nothing but
verify_select_k{K} at [exact_batch_size, K+1], and a planted M=1 greedy step is caught.
"""

from __future__ import annotations

import numpy as np
import pytest

import ortspec
from ortspec.runtime.forward_shapes import ExactShape, FixedShape
from ortspec.runtime.graphs import GraphRunner, GraphSet
from ortspec.speculative.exactness import check_speculative, plain_decode_states

PROMPTS = [[5, 17, 99, 3, 250, 7, 11], [42], [8, 8, 8, 300, 1, 2, 3, 4, 5, 6, 7], [1, 2], [400, 3, 3, 3]]
B_FIX, NEW = 4, 20


@pytest.fixture(scope="module")
def model(models):
    return models.converted("base")  # K = 4


@pytest.fixture(scope="module")
def greedy(model):
    return ortspec.Session(model).generate(PROMPTS, max_new_tokens=NEW)


def exact_session(model, k=0, commit="select"):
    return ortspec.Session(model, num_speculative_tokens=k, commit=commit, exact=True, exact_batch_size=B_FIX)


@pytest.mark.parametrize("count", [1, 3, 5])  # one group, one group with a placeholder row, two groups
def test_exact_greedy_equals_default_greedy(model, greedy, count):
    assert exact_session(model).generate(PROMPTS[:count], max_new_tokens=NEW) == greedy[:count]


@pytest.mark.parametrize("commit", ["select", "readvance"])
def test_exact_speculative_equals_greedy(model, greedy, commit):
    """k = 1..4 at a batch of 5 (two groups); batches of 1 and 3 (one group) for some k."""
    for k, counts in ((1, (5, 1)), (2, (5, 3)), (3, (5,)), (4, (5, 1))):
        session = exact_session(model, k, commit)
        for count in counts:
            assert session.generate(PROMPTS[:count], max_new_tokens=NEW) == greedy[:count], (commit, k, count)
        assert session.stats["position_mismatches"] == 0


@pytest.mark.parametrize("commit", ["select", "readvance"])
def test_exact_states_equal_plain_decode_after_every_commit(model, commit):
    """Scripted drafts drive every accept length; 5 requests run as two groups of 4 rows; after
    every commit each request's states equal the default plain decode's bitwise."""
    graphs = GraphSet(ortspec.Session(model).manifest)
    for k in (2, 4):
        reference = plain_decode_states(graphs, PROMPTS, 40 + k + 1, k)
        stats = check_speculative(graphs, PROMPTS, 40, k, commit, p=None, seed=k, reference=reference,
                                  exact=ExactShape(B_FIX, 4))
        assert min(stats.accept_histogram) >= 5 and stats.speculative_row_steps > 50


def test_exact_batcher_with_staggered_arrivals(model):
    from tests.test_batching import REQUESTS, run_staggered, solo_references

    solo = [ortspec.Session(model).generate(prompt, max_new_tokens=n) for prompt, n in REQUESTS]
    session = exact_session(model, 3)
    outputs, checked = run_staggered(session, refs=solo_references(GraphSet(session.manifest), 3))
    assert outputs == solo and len(checked) > 60
    with session.batcher(max_batch_size=3) as batcher:  # 3 requests, 4 engine rows: one stays a placeholder
        assert len(batcher.rows) == B_FIX and batcher.max_batch_size == 3


# -- the shape discipline ----------------------------------------------------------------------

def target_shapes(monkeypatch, call) -> set[tuple[str, tuple[int, ...]]]:
    """(graph, input_ids shape) of every target forward that ``call()`` ran after its prefills."""
    ran = []
    original = GraphRunner.run

    def spy(self, feeds, slot=None, wait=True):
        if not self.name.startswith(("prefill", "mtp", "sample_logits")):  # sample_logits: a prefill's choice
            ran.append((self.name, tuple(np.shape(feeds["input_ids"]))))
        return original(self, feeds, slot, wait)

    with monkeypatch.context() as patch:
        patch.setattr(GraphRunner, "run", spy)
        call()
    return set(ran)


FIXED = {("verify_select_k4", (B_FIX, 5))}


@pytest.mark.parametrize("k,commit", [(0, "select"), (2, "select"), (3, "readvance")])
def test_every_target_forward_runs_at_the_fixed_shape(model, monkeypatch, k, commit):
    session = exact_session(model, k, commit)
    assert target_shapes(monkeypatch, lambda: session.generate(PROMPTS, max_new_tokens=NEW)) == FIXED
    default = ortspec.Session(model, num_speculative_tokens=k, commit=commit)
    assert target_shapes(monkeypatch, lambda: default.generate(PROMPTS, max_new_tokens=NEW)) != FIXED


def test_a_planted_greedy_step_at_its_own_shape_is_caught(model, greedy, monkeypatch):
    """A greedy step that runs the M=1 decode graph, as the default mode does: same tokens on the
    CPU, so only the shape check can catch it."""
    monkeypatch.setattr(FixedShape, "advance", lambda self, rows, ids, positions: self.target.decode(rows, ids,
                                                                                                     positions))
    session = exact_session(model)
    assert session.generate(PROMPTS, max_new_tokens=NEW) == greedy  # the bits cannot tell
    assert target_shapes(monkeypatch, lambda: session.generate(PROMPTS, max_new_tokens=NEW)) != FIXED


def test_a_servers_warm_up_in_exact_mode(model, greedy):
    """An exact-mode server warms up too (every step runs one shape, so in one row), auto k's every
    k and switch included, and then serves greedy's tokens."""
    session = ortspec.Session(model, num_speculative_tokens="auto", exact=True, exact_batch_size=2)
    with session.batcher(max_batch_size=2) as batcher:
        batcher.warm_up()
        assert batcher.requests == {} and session.stats["auto_k"]["windows"] == {}
        rid = batcher.add_request(PROMPTS[0], max_new_tokens=NEW)
        while batcher.pending:
            batcher.step()
        assert batcher.result(rid) == greedy[0]


# -- limits and errors -------------------------------------------------------------------------

def test_exact_mode_reserves_k_positions(tokenized_model):
    """max_length 48, K 3: a request may hold 45 tokens in exact mode, 48 otherwise."""
    prompt = list(range(1, 41))
    session = ortspec.Session(tokenized_model, num_speculative_tokens=2, exact=True, exact_batch_size=2)
    greedy = ortspec.Session(tokenized_model).generate(prompt, max_new_tokens=5)
    assert session.generate(prompt, max_new_tokens=5) == greedy
    with pytest.raises(ortspec.InputError, match=r"46 > max_length=48 .* less the 3 positions exact mode reserves"):
        session.generate(prompt, max_new_tokens=6)
    assert session.generate(prompt[:3], max_new_tokens=5) == ortspec.Session(tokenized_model).generate(
        prompt[:3], max_new_tokens=5)  # still usable


def test_exact_options(tokenized_model):
    session = ortspec.Session(tokenized_model, num_speculative_tokens=2, exact=True, exact_k=2)
    assert session.exact == ExactShape(16, 2) and ortspec.Session(tokenized_model).exact is None
    with pytest.raises(ortspec.InputError, match="fixed_rows=False cannot run in exact mode"):
        session.generate([1, 2, 3], max_new_tokens=4, fixed_rows=False)


def test_exact_mode_needs_verify_graphs(tmp_path):
    from tools.make_tiny_checkpoint import make_checkpoint

    make_checkpoint(tmp_path / "ck", seed=4, mtp=False)  # no MTP head: converted with K=0, no verify graphs
    out = ortspec.convert(tmp_path / "ck", tmp_path / "out", max_length=32, progress=False)
    with pytest.raises(ortspec.ConfigurationError, match=r"no mtp\.\* weights, .* exact mode is not available"):
        ortspec.Session(out, exact=True)


# -- sampling in exact mode ----------------------------------------------------------------------

HOT = dict(temperature=4.0, top_p=0.98)  # flat enough that the random model's drafts are often kept


@pytest.mark.parametrize("k,commit", [(0, "select"), (2, "select"), (3, "readvance")])
def test_exact_sampling_equals_default_sampling(model, greedy, monkeypatch, k, commit):
    """Sampled requests read the logits of a forward's first k+1 rows (pads follow), from each
    group of B_fix rows: on the CPU a seed gives exact mode the default mode's tokens (5 requests:
    two groups, three placeholder rows), and every target forward still runs at the fixed shape."""
    want = ortspec.Session(model, num_speculative_tokens=k, commit=commit).generate(PROMPTS, max_new_tokens=NEW,
                                                                                    seed=3, **HOT)
    assert want != greedy
    session, got = exact_session(model, k, commit), []
    shapes = target_shapes(monkeypatch, lambda: got.append(session.generate(PROMPTS, max_new_tokens=NEW, seed=3,
                                                                            **HOT)))
    assert got == [want] and shapes == FIXED
    assert k == 0 or session.stats["accepted"] > 0


def test_exact_batcher_mixes_greedy_and_sampled_requests(model, greedy):
    """A greedy and a sampled request side by side in exact mode's batcher: each gets what it gets
    alone in the default mode (the greedy row runs the sampling graph at temperature 0)."""
    sampled = ortspec.Session(model, num_speculative_tokens=2).generate(PROMPTS[2], max_new_tokens=NEW, seed=9, **HOT)
    with exact_session(model, 2).batcher(max_batch_size=2) as batcher:
        a = batcher.add_request(PROMPTS[0], max_new_tokens=NEW)
        b = batcher.add_request(PROMPTS[2], max_new_tokens=NEW, seed=9, **HOT)
        while batcher.pending:
            batcher.step()
        assert batcher.result(a) == greedy[0] and batcher.result(b) == sampled
