"""Where drafts come from: the MTP head, or (for tests) a scripted source.

A draft source answers ``propose(batch, k) -> int64 [B, k]``. With the scripted source the
MTP head still runs at every catch-up exactly as in production (its cache and its drafts
are kept and compared); the script only replaces the proposed tokens, which lets tests drive
every accept length 0..k on random-weight models that would otherwise accept almost nothing.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from ..runtime.model import MTPHead
from .requests import Batch, Request


class DraftSource(Protocol):
    def propose(self, batch: Batch, k: int) -> np.ndarray: ...


class MTPDrafts:
    """The drafts the MTP head proposed at its last catch-up (d1 from the target's hidden at
    the last committed position, d2..dk recursively from its own output): the head drafts
    for the next step in the same graph run as its catch-up, so proposing costs no forward."""

    def __init__(self, mtp: MTPHead) -> None:
        self.mtp = mtp

    def propose(self, batch: Batch, k: int) -> np.ndarray:
        return self.of(batch, k)

    @staticmethod
    def of(batch: Batch, k: int) -> np.ndarray:
        """[B, k]: each request's first k drafts; a placeholder row (never caught up) proposes zeros."""
        return np.array([(r.next_drafts + [0] * k)[:k] for r in batch.requests], np.int64).reshape(len(batch), k)


class ScriptedDrafts:
    """Drafts that are right where a script says: each draft right with probability ``p``,
    or (p=None) an accept length drawn uniformly from 0..k each step.

    ``oracle(request)`` is that request's plain-greedy token sequence (prompt + continuation,
    at least k tokens past the end); a wrong draft is the right token + 1 (mod vocab).
    """

    def __init__(self, mtp_drafts: MTPDrafts, oracle: Callable[[Request], list[int]], vocab_size: int,
                 p: float | None = None, seed: int = 0) -> None:
        self.inner, self.oracle, self.vocab_size, self.p = mtp_drafts, oracle, vocab_size, p
        self.rng = np.random.default_rng(seed)

    def propose(self, batch: Batch, k: int) -> np.ndarray:
        """[B, k]: the truth where the script says right, truth + 1 elsewhere. With ``p`` the
        draws are one [B, k] array (the same stream as a draw of k per row, in row order) and the
        drafts one ``np.where``: a timing run (tools/gpu.py agree) pays this in its propose phase,
        where the MTP head's own drafts cost almost nothing."""
        drafts = self.inner.propose(batch, k)
        if self.p is None:
            right = np.stack([np.arange(k) < self.rng.integers(0, k + 1) for _ in batch.requests]).reshape(-1, k)
        else:
            right = self.rng.random((len(batch), k)) < self.p  # [B, k]
        correct = np.zeros_like(drafts)  # [B, k]: draft i of row j predicts token x_{T_j+1+i}
        for j, req in enumerate(batch.requests):
            truth = self.oracle(req)[req.processed + 1: req.processed + 1 + k]  # 0 past the oracle's end
            correct[j, : len(truth)] = truth
        return np.where(right, correct, (correct + 1) % self.vocab_size)
