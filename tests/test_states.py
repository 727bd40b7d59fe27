"""The state protocol: each kind answers only the verbs it has, and rollback fails loudly."""

from __future__ import annotations

import numpy as np
import pytest

import ortspec
from ortspec.runtime.arrays import HostArrays
from ortspec.runtime.graphs import GraphSet
from ortspec.runtime.model import TargetModel
from ortspec.runtime.states import KVCache, LayerState, PositionalState, ReplacedState, Rows, StateError


@pytest.fixture(scope="module")
def target(models):
    graphs = GraphSet(ortspec.Session(models.converted("base")).manifest)
    return TargetModel(graphs, batch=2)


def protocol_verbs(protocol) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")} - {"names", "arrays", "buffer", "buffers",
                                                                             "out_name", "window_name"}


def test_each_kind_answers_its_own_verbs_only(target):
    """KV caches are written by position and need no rollback: no snapshot, restore or capture
    (no no-op methods); GDN states are replaced whole and answer the rollback verbs."""
    states, table = target.states, target.graphs.manifest.states
    assert {c.names[0] for c in states.caches} == {n for n, e in table.items() if e["kind"] == "kv_key"}
    assert {s.names[0] for s in states.layers} == {n for n, e in table.items() if e["kind"] in ("conv", "recurrent")}
    assert all(hasattr(KVCache, verb) for verb in protocol_verbs(PositionalState))
    assert all(hasattr(LayerState, verb) for verb in protocol_verbs(ReplacedState))
    assert not any(hasattr(KVCache, verb) for verb in ("snapshot", "restore", "capture", "put", "advance", "zero"))


def test_rollback_fails_loudly_naming_both_lengths(target):
    rows = Rows([0, 1])
    ids, positions = np.array([[3, 4], [5, 6]]), np.array([[0, 1], [0, 1]])
    target.reset(rows)
    target.prefill(rows, ids, positions)
    snapshot = target.snapshot(rows, np.array([2, 2]))
    before = target.states.row_state(1, 2)
    target.decode(rows, np.array([[7], [8]]), np.array([[2], [2]]))
    with pytest.raises(StateError, match=r"taken at lengths \[2, 2\] restored at lengths \[3, 2\]"):
        target.restore(snapshot, rows, np.array([3, 2]))
    with pytest.raises(StateError, match=r"snapshot of rows \[0, 1\] restored into rows \[1\]"):
        target.restore(snapshot, Rows([1]), np.array([2]))
    target.restore(snapshot, rows, np.array([2, 2]))
    after = target.states.row_state(1, 2)
    assert all(np.array_equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("positions", [[[5, 6, 7], [0, 1, 2]], [[5, 0, 2], [1, 3, 6]]],
                         ids=["consecutive", "scattered"])
@pytest.mark.parametrize("counts", [None, [3, 1]])
def test_host_write_rows_puts_each_new_row_at_its_position(positions, counts):
    """HostArrays.write_rows (slices where a row's positions run on, an index array elsewhere) against
    a one-row-at-a-time reference, for both KV layouts: key [B, kvh, hd, L], value [B, kvh, L, hd]."""
    rng = np.random.default_rng(3)
    positions, counts = np.array(positions), None if counts is None else np.array(counts)
    for shape, axis in (((2, 2, 4, 8), 3), ((2, 2, 8, 4), 2)):
        cache = rng.standard_normal(shape).astype(np.float32)
        new = rng.standard_normal(shape[:axis] + (3,) + shape[axis + 1:]).astype(np.float32)
        expected = cache.copy()
        for b in range(2):
            for j in range(3 if counts is None else counts[b]):
                np.moveaxis(expected[b], axis - 1, 0)[positions[b, j]] = np.moveaxis(new[b], axis - 1, 0)[j]
        HostArrays().write_rows(cache, new, positions, counts, axis)
        assert np.array_equal(cache, expected)


def test_host_write_rows_of_a_decode_puts_each_row_at_its_position():
    """A decode's write (M = 1, no counts: an int index per row) against the same reference."""
    rng = np.random.default_rng(4)
    positions = np.array([[5], [0]])
    for shape, axis in (((2, 2, 4, 8), 3), ((2, 2, 8, 4), 2)):
        cache = rng.standard_normal(shape).astype(np.float32)
        new = rng.standard_normal(shape[:axis] + (1,) + shape[axis + 1:]).astype(np.float32)
        expected = cache.copy()
        for b in range(2):
            np.moveaxis(expected[b], axis - 1, 0)[positions[b, 0]] = np.moveaxis(new[b], axis - 1, 0)[0]
        HostArrays().write_rows(cache, new, positions, None, axis)
        assert np.array_equal(cache, expected)
