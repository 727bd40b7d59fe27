"""Session.stats: every counter means one documented thing, the counters add up, and the
phase times (disjoint by construction) fit inside the wall time of the calls they measure."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import time

import pytest

import ortspec
from ortspec.speculative import stats as stats_module
from ortspec.speculative.batcher import run_arrivals
from ortspec.speculative.stats import DERIVED, NestedPhaseError, Stats

# The last prompt leaves fewer than k positions before max_length (256) for its last steps,
# so a speculative session also takes decode steps.
PROMPTS = [[5, 17, 99, 3, 250, 7, 11], [42], list(range(1, 242))]


def check_consistent(st: dict, k: int, batch: int) -> None:
    assert st["steps"] == st["decode_steps"] + st["speculative_steps"]
    assert st["speculative_row_steps"] == sum(st["accept_histogram"])
    assert st["speculative_steps"] <= st["speculative_row_steps"] <= batch * st["speculative_steps"]
    assert st["drafted"] == k * st["speculative_row_steps"]
    assert st["accepted"] == sum(a * n for a, n in enumerate(st["accept_histogram"]))
    assert st["position_mismatches"] == 0


@pytest.mark.parametrize("commit", ["select", "readvance"])
def test_counters_add_up_and_phases_fit_in_the_wall_time(models, commit):
    session = ortspec.Session(models.converted("base"), num_speculative_tokens=3, commit=commit, threads=1)
    start = time.perf_counter()
    outputs = session.generate(PROMPTS, max_new_tokens=14)
    wall = time.perf_counter() - start
    st = session.stats
    check_consistent(st, k=3, batch=len(PROMPTS))
    assert st["decode_steps"] > 0 and st["speculative_steps"] > 0  # both kinds ran
    assert st["requests"] == 3 and st["generated_tokens"] == sum(map(len, outputs)) == 42
    assert sum(st["seconds"].values()) <= wall
    rejected = sum(st["accept_histogram"][:3])  # row-steps with a < k: readvance re-runs 1..k forwards
    if commit == "readvance":
        assert rejected > 0 and 0 < st["readvance_forwards"] <= 3 * st["speculative_steps"]
    else:
        assert st["readvance_forwards"] == 0


def test_batcher_counts_into_the_session_stats(models):
    session = ortspec.Session(models.converted("base"), num_speculative_tokens=2, threads=1)
    start = time.perf_counter()
    outputs = run_arrivals(session.batcher(max_batch_size=2), [([1, 2, 3], 12), ([4], 7), ([5, 6], 9)])
    wall = time.perf_counter() - start
    st = session.stats
    check_consistent(st, k=2, batch=2)
    assert st["requests"] == 3 and st["generated_tokens"] == sum(map(len, outputs)) == 28
    assert sum(st["seconds"].values()) <= wall


def test_greedy_session_takes_only_decode_steps(models):
    session = ortspec.Session(models.converted("base"), threads=1)
    session.generate(PROMPTS[:2], max_new_tokens=6)
    st = session.stats
    assert st["steps"] == st["decode_steps"] == 5 and st["speculative_steps"] == 0  # the first token is prefill's
    assert st["mean_tokens_per_step"] == 1.0 and st["drafted"] == 0 and st["acceptance_rate"] == 0.0


def test_nested_phases_are_refused():
    """A timer inside another would count its time twice; the second one raises instead."""
    stats = Stats()
    with stats.timed("verify"):
        with pytest.raises(NestedPhaseError, match="'commit' started inside phase 'verify'"):
            with stats.timed("commit"):
                pass
    with stats.timed("commit"):  # the refused timer left nothing running
        pass
    assert stats.seconds["commit"] >= 0.0 and stats.seconds["verify"] > 0.0


def test_every_stat_has_a_docstring():
    """Each counter (a docstring under its field) and each derived rate (a property's docstring)."""
    tree = ast.parse(inspect.getsource(stats_module))
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Stats").body
    documented = {node.target.id for node, after in zip(body, body[1:])
                  if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
                  and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)}
    fields = {f.name for f in dataclasses.fields(Stats) if not f.name.startswith("_")}
    assert fields <= documented, f"counters without a docstring: {sorted(fields - documented)}"
    assert all(inspect.getdoc(getattr(Stats, name)) for name in DERIVED)
    assert set(Stats().as_dict()) == fields | set(DERIVED)
