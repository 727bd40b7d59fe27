"""tools/cpu_fused_ops.py: each fused CPU kernel and the CPU graphs' chain it is timed against
compute the same thing (outputs and per-row states, within float32 rounding), so the table
compares like with like; timings are printed, never asserted."""

from __future__ import annotations

import numpy as np
import pytest

from tools import cpu_fused_ops


@pytest.mark.parametrize("name", list(cpu_fused_ops.PIECES))
@pytest.mark.parametrize("rows", [1, 3])
def test_fused_op_and_chain_agree(name, rows, tmp_path):
    chain, fused, _ = cpu_fused_ops.PIECES[name]
    (a, _), (b, _) = (cpu_fused_ops.session(build, rows, 1, tmp_path) for build in (chain, fused))
    feeds = cpu_fused_ops.piece_feeds(name, np.random.default_rng(0), 2, rows)
    out_a, out_b = a.run(None, feeds), b.run(None, feeds)
    if name == "recurrence" and rows > 1:  # the fused side stacks its per-row states [M, B, ...]
        out_b = [out_b[0].reshape(out_a[0].shape), *out_b[1]]
    assert len(out_a) == len(out_b) == (1 if name == "gated norm" else rows + 1)
    for x, y in zip(out_a, out_b):
        np.testing.assert_allclose(x.reshape(y.shape), y, rtol=1e-4, atol=1e-5)


def test_a_table_row_names_both_sides(tmp_path):
    row = cpu_fused_ops.measure("gated norm", 1, 1, threads=1, rounds=1, work=tmp_path)
    assert row[:4] == ["gated norm", "GatedRMSNorm", 1, 1] and row[4].endswith("(5)") and row[5].endswith("(1)")
