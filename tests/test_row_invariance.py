"""The ops the graphs are built from compute a token's row the same way whatever rows share the
call (CPU EP): the premise of bitwise-exact speculative decoding on the CPU, op by op, so that an
ONNX Runtime upgrade that breaks it names the op (tools/row_invariance.py prints the table)."""

from __future__ import annotations

import pytest

from tools.row_invariance import cases, row_invariant, window_invariant

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
