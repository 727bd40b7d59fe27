"""Which shape each target forward runs at.

The speculative layer asks for target forwards by what they keep, never by graph or shape:

    advance(rows, ids, positions)   ids/positions [B, m]: keep every state after the last of the m tokens
    windows(rows, ids, positions)   ids/positions [B, m]: keep nothing; the outputs hold the state after each
    select(out, rows, accepted)     keep the state after token accepted[j] of a windows() forward

Both return a ``Forward`` whose ``tokens``, ``hidden`` and ``positions`` are [B, m, ...].

``ShapePerCall`` runs each forward at its own shape over the call's rows: M=1 ``decode``,
M=k+1 ``verify_k{k}`` / ``verify_select_k{k}``. On the CPU that is bitwise exact (every
product of the graphs gives a row the same bits at any M and B; README, "How it works").
On a GPU it is not in fp16/bf16: cuBLAS picks kernels and reduction orders by shape, so a
token's logits depend on M and on the batch bucket (issue 12; BENCHMARKS.md).
"""

from __future__ import annotations

import numpy as np

from .model import Forward, TargetModel
from .states import Rows


class ShapePerCall:
    """Default: each forward at its own shape ([B, 1] decode, [B, k+1] verify) over the call's rows."""

    def __init__(self, target: TargetModel) -> None:
        self.target = target

    def positions_used(self, k: int) -> int:
        """Positions from T that the widest forward of a k-draft step writes."""
        return k + 1

    def advance(self, rows: Rows, ids: np.ndarray, positions: np.ndarray) -> Forward:
        if ids.shape[1] == 1:
            return self.target.decode(rows, ids, positions)
        return self.target.verify(rows, ids, positions)

    def windows(self, rows: Rows, ids: np.ndarray, positions: np.ndarray) -> Forward:
        return self.target.verify_windows(rows, ids, positions)

    def select(self, out: Forward, rows: Rows, accepted: np.ndarray) -> None:
        self.target.select(out, rows, out.positions, accepted)
