"""The ops the graphs are built from compute a token's row the same way whatever rows share the
call (CPU EP): the premise of bitwise-exact speculative decoding on the CPU, op by op, so that an
ONNX Runtime upgrade that breaks it names the op (tools/row_invariance.py prints the table)."""

from __future__ import annotations

import pytest

from ortspec.converter.layers import make_gated_deltanet
from tools import row_invariance
from tools.row_invariance import cases, gdn_rows_invariant, row_invariant, window_invariant

RELIED_ON = [c for c in cases() if c.relied_on]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", RELIED_ON, ids=[f"{c.op} ({c.used})" for c in RELIED_ON])
def test_op_is_row_invariant(case, threads):
    assert row_invariant(case, threads=threads)


def test_the_check_detects_a_row_dependent_kernel():
    """Planted: a plain MatMul against a computed operand takes a one-row kernel for M=1."""
    case = next(c for c in cases() if c.op == "MatMul, computed right operand")
    assert not row_invariant(case, threads=1)


@pytest.mark.parametrize("threads", [1, 2])
def test_attention_bits_do_not_depend_on_the_cache_window(threads):
    assert window_invariant(threads)


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_graphs_gdn_layer_gives_a_verify_row_its_decode_bits(threads):
    assert gdn_rows_invariant(threads)


def test_the_gdn_check_detects_a_verify_of_another_formulation(monkeypatch):
    """Planted: verify windows from the portable layer (LinearAttention per row, the fused conv
    and norm) against the CPU layer's decodes: each is exact alone, the mix is not."""
    original = row_invariance.make_gated_deltanet_rows

    def portable_verify(g, spec, x, prefix, conv, rec, rows, windows):
        if rows == 1:
            return original(g, spec, x, prefix, conv, rec, rows, windows)
        g.weights.add(f"{prefix}.conv", g.weights.arrays[f"{prefix}.conv_taps"].T[:, None])  # [K, C] -> [C, 1, K]
        out, conv_window, rec_window = make_gated_deltanet(g, spec, x, prefix, conv, rec, per_position=rows)
        per_row = [[g.op("Gather", [w, g.const(j)], axis=0) for j in range(rows)] for w in (conv_window, rec_window)]
        return out, *per_row  # [M, B, ...] -> M per-row states, as the CPU layer emits them

    monkeypatch.setattr(row_invariance, "make_gated_deltanet_rows", portable_verify)
    assert not gdn_rows_invariant(threads=1)
