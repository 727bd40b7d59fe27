"""The CPU's forwards over IOBinding (runtime/host_binding.py) and what they rest on: rows moved into
consecutive slots (runtime/row_slots.py) and double-buffered GDN states (StateSet.flip). Every state
must come out bit for bit as the plain path (session.run, outputs copied into the live buffers)
leaves it, whatever rows each forward runs."""

from __future__ import annotations

import numpy as np
import pytest

import ortspec
from ortspec.runtime.decode_run import DecodeRun
from ortspec.runtime.fused_run import FusedRun
from ortspec.runtime.graphs import GraphSet
from ortspec.runtime.model import TargetModel
from ortspec.runtime.row_slots import Rows, RowSlots


@pytest.mark.parametrize("rows", [[0, 2], [1, 3], [0, 1, 3], [3, 1], [2], [0, 1, 2, 3]])
def test_placed_rows_fill_consecutive_slots_in_their_order(rows):
    slots = RowSlots(4)
    slots.place(Rows([3, 0]))  # an earlier placement: the map is no longer the identity
    swaps = slots.place(Rows(rows))
    placed = slots.slots(Rows(rows))
    assert placed.slice is not None and placed.indices.tolist() == list(range(placed.slice.start, placed.slice.stop))
    assert sorted(slots.slot(r) for r in range(4)) == [0, 1, 2, 3]  # still one slot per row
    assert slots.place(Rows(rows)) == [] and len(swaps) <= len(rows)  # placed rows stay where they are


def forward(target: TargetModel, rows: list[int], step: int, bound: bool) -> None:
    """One decode step of these rows, over IOBinding (bound) or through session.run."""
    rows = Rows(rows)
    ids = np.array([[7 + 3 * r + step] for r in rows.indices], np.int64)  # [B, 1]
    positions = np.full((len(rows), 1), 4 + step, np.int64)  # [B, 1]
    if bound:
        out = target.bound_forward("decode", rows, {"input_ids": ids, "positions": positions})
        target.states.flip(rows, positions, out)
    else:
        target.decode(rows, ids, positions)


def test_bound_decodes_over_any_rows_leave_the_states_of_plain_ones(models):
    """Rows 0..3 prefilled, then decode steps over changing subsets; some steps change rows through
    the plain path in between (what a prefill or a select commit does to the live buffers), so a
    flip must first bring the spare rows of those up to date. Every row's states stay bitwise the
    plain path's throughout."""
    graphs = GraphSet(ortspec.Session(models.converted("base")).manifest)
    bound, plain = TargetModel(graphs, batch=4), TargetModel(graphs, batch=4)
    for target in (bound, plain):
        rows = Rows(range(4))
        target.reset(rows)
        target.prefill(rows, np.arange(16, dtype=np.int64).reshape(4, 4) + 5, np.tile(np.arange(4), (4, 1)))
    schedule = [([0, 1, 2, 3], True), ([1, 3], True), ([0], False), ([0, 1, 3], True), ([2, 3], True),
                ([1, 2], False), ([0, 1, 2, 3], True), ([3], True)]
    for step, (rows, on_binding) in enumerate(schedule):
        forward(bound, rows, step, bound=on_binding)
        forward(plain, rows, step, bound=False)
        for row in range(4):
            got, want = bound.states.row_state(row, 4 + step + 1), plain.states.row_state(row, 4 + step + 1)
            assert got.keys() == want.keys() and all(np.array_equal(got[n], want[n]) for n in want), (step, rows, row)
    assert bound.states.flips == sum(on for _, on in schedule)


@pytest.mark.parametrize("k", [0, 2])
def test_runs_over_bindings_give_the_tokens_of_plain_runs_sampled_and_over_a_subset(models, monkeypatch, k):
    """Sampled rows (drawn on the device: decode_sample / verify_mtp_sample_k2, which read the
    drafts' distributions where the last step left them) and a greedy one, the middle request done
    early so the last steps run rows 0 and 2: the same tokens over IOBinding as through session.run."""
    requests = [dict(prompt=[5, 17, 99, 3, 250, 7, 11], max_new_tokens=24, temperature=0.8, seed=7),
                dict(prompt=[42, 8], max_new_tokens=5, temperature=0.8, seed=8),
                dict(prompt=[8, 8, 8, 300, 1, 2, 3, 4, 5], max_new_tokens=24)]

    def generate(bound: bool) -> list[list[int]]:
        monkeypatch.setattr(DecodeRun, "host_binding", bound)
        monkeypatch.setattr(FusedRun, "host_binding", bound)
        session = ortspec.Session(models.converted("base"), num_speculative_tokens=k)
        with session.batcher(max_batch_size=3) as batcher:
            ids = batcher.add_requests(requests)
            while batcher.pending:
                batcher.step()
            return [batcher.result(i) for i in ids]

    assert generate(True) == generate(False)
