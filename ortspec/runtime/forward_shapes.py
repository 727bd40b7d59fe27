"""Which shape each target forward runs at: the call's own (default), or one fixed shape (exact mode).

The speculative layer asks for target forwards by what they keep, never by graph or shape:

    advance(rows, ids, positions)   ids/positions [B, m]: keep every state after the last of the m tokens
    windows(rows, ids, positions)   ids/positions [B, m]: keep nothing; the outputs hold the state after each
    select(out, rows, accepted)     keep the state after token accepted[j] of a windows() forward

Both return a ``Forward`` whose ``tokens``, ``hidden`` and ``positions`` are [B, W, ...] with
W >= m: the first m columns are the call's tokens (in exact mode pads follow).

``ShapePerCall`` (default) runs each forward at its own shape over the call's rows: M=1
``decode``, M=k+1 ``verify_k{k}`` / ``verify_select_k{k}``. On the CPU that is bitwise exact
(every product gives a row the same bits at any M and B; README, "How it works"). On a GPU
it is not in fp16/bf16: cuBLAS picks kernels and reduction orders by shape, so a token's
logits depend on M and on the batch bucket (issue 12; BENCHMARKS.md).

``FixedShape`` (exact mode) runs every post-prefill forward, greedy or speculative, as
``verify_select_k{K}`` at one shape [B_fix, K+1]: a row's m real tokens, then pad tokens at
the next positions; the batch in groups of B_fix contiguous rows (B_fix divides the engine's
rows; placeholders fill the rest), over all max_length KV slots on CUDA too (a KV window
variant, chosen by the group's furthest position, would make a token's products depend on the
positions beside it). Every product then has the same shape every time, so
the GPU libraries pick the same kernel and reduction order every time, and a token's bits
depend on its own inputs only, provided a fixed-shape product gives a row the same bits at
any row index (tiled GEMMs without batch-dependent split-K; ``tools/gpu.py exact`` checks it).
Rows never mix (row-wise products, per-row mask and recurrence) and pads come after a row's
real tokens (causal), so pads and other requests never reach a real token. Prefill is per
request at any length in both modes on a GPU, the same computation alone or in a batch (the
CPU prefills prompts of one length together: a row's bits there do not depend on its neighbours).
Cost: K+1 rows per request every step, B_fix rows at any batch size; and K positions at
the end of max_length are reserved for the pads (``ExactShape.usable_length``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..manifest import graph_name
from .model import Forward, TargetModel
from .states import Rows, StateError

PAD_TOKEN = 0  # any id: a pad comes after every real token of its row, so nothing real attends to it


@dataclasses.dataclass(frozen=True)
class ExactShape:
    """Exact mode's one forward shape: ``batch_size`` rows (B_fix) x ``k + 1`` tokens (K_fix + 1).

    Exactness holds between runs of one model and dtype with the same ExactShape (any batch
    size, any k <= K_fix, either commit)."""

    batch_size: int  # B_fix
    k: int  # K_fix: the verify width of the fixed graph, verify_select_k{k}

    @property
    def graph(self) -> str:
        return graph_name("verify_select", self.k)

    def rows_for(self, requests: int) -> int:
        """Engine rows for this many requests: whole groups of B_fix."""
        return -(-requests // self.batch_size) * self.batch_size

    def usable_length(self, max_length: int) -> int:
        """Prompt + generated tokens that fit: the last K positions hold the pads of the last step."""
        return max_length - self.k


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


class FixedShape:
    """Exact mode: every forward as ``shape.graph`` at [B_fix, K+1] (module docstring)."""

    def __init__(self, target: TargetModel, shape: ExactShape) -> None:
        self.target, self.shape = target, shape
        self.max_length = target.graphs.manifest.max_length
        self._groups: dict[tuple[int, int], list[tuple[slice, Rows]]] = {}
        self._hidden = None  # [rows, K+1, H]: the groups' hiddens side by side, for the MTP head (fixed address)

    def positions_used(self, k: int) -> int:
        return self.shape.k + 1

    def advance(self, rows: Rows, ids: np.ndarray, positions: np.ndarray) -> Forward:
        """The fixed forward, then the state after token m-1 of every row (a greedy step: slot 0)."""
        out = self.windows(rows, ids, positions)
        self.select(out, rows, np.full(len(rows), ids.shape[1] - 1, np.int64))
        return out

    def windows(self, rows: Rows, ids: np.ndarray, positions: np.ndarray) -> Forward:
        ids, positions = self._pad(ids, positions)  # [B, K+1]
        parts = [self.target.verify_windows(group, ids[part], positions[part], kv_window=False)  # one shape
                 for part, group in self.groups(rows)]
        return self._merge(parts, positions)

    def select(self, out: Forward, rows: Rows, accepted: np.ndarray) -> None:
        for (part, group), group_out in zip(self.groups(rows), out.parts):
            self.target.select(group_out, group, group_out.positions, accepted[part])

    def groups(self, rows: Rows) -> list[tuple[slice, Rows]]:
        """(slice of the call's rows, their batch rows) per group of B_fix contiguous rows."""
        n, size = len(rows), self.shape.batch_size
        if rows.slice is None or n % size:
            raise StateError(f"exact mode runs contiguous rows in groups of exact_batch_size={size}; got rows "
                             f"{rows.indices.tolist()}. Pad the batch with placeholder requests (Session does).")
        key = (rows.slice.start, n)
        if key not in self._groups:
            self._groups[key] = [(slice(j, j + size), Rows(rows.indices[j: j + size])) for j in range(0, n, size)]
        return self._groups[key]

    def _pad(self, ids: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[B, m] -> [B, K+1]: pad tokens after the real ones, at the positions that follow."""
        width = self.shape.k + 1
        if ids.shape[1] > width:
            raise StateError(f"a forward over {ids.shape[1]} tokens per row does not fit exact mode's "
                             f"{width}; use num_speculative_tokens <= exact_k={self.shape.k}.")
        padded = np.full((len(ids), width), PAD_TOKEN, np.int64)
        padded[:, : ids.shape[1]] = ids
        spread = positions[:, :1] + np.arange(width)  # [B, K+1]
        if int(spread.max()) >= self.max_length:
            raise StateError(f"exact mode needs positions up to {int(spread.max())}, past max_length="
                             f"{self.max_length}: a request may hold at most {self.shape.usable_length(self.max_length)}"
                             " tokens (prompt + max_new_tokens) in exact mode.")
        return padded, spread

    def _merge(self, parts: list[Forward], positions: np.ndarray) -> Forward:
        """One Forward over all rows: tokens side by side (host), the hiddens in one buffer; the
        logits stay in the parts (``Forward.logits`` reads them there, only when a request samples)."""
        out = Forward(parts[0]) if len(parts) == 1 else Forward(hidden=self._merged_hidden(parts))
        out.tokens = np.concatenate([p.tokens for p in parts]) if len(parts) > 1 else parts[0].tokens
        out.positions, out.parts, out.keep_alive = positions, parts, [p.keep_alive for p in parts]
        out.arrays = parts[0].arrays
        return out

    def _merged_hidden(self, parts: list[Forward]):
        arrays, size = self.target.graphs.arrays, self.shape.batch_size
        first = parts[0]["hidden"]  # [B_fix, K+1, H]
        if self._hidden is None or self._hidden.shape[0] != size * len(parts):
            self._hidden = arrays.zeros((size * len(parts),) + tuple(first.shape[1:]), first.dtype)
        for g, part in enumerate(parts):
            arrays.copy(arrays.rows(self._hidden, g * size, (g + 1) * size), part["hidden"])
        return self._hidden
