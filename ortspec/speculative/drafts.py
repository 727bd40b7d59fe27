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
        """[B, k]; a placeholder row (never caught up) proposes zeros."""
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
        drafts = self.inner.propose(batch, k)
        for j, req in enumerate(batch.requests):
            truth = self.oracle(req)
            if self.p is None:
                right = np.arange(k) < self.rng.integers(0, k + 1)
            else:
                right = self.rng.random(k) < self.p
            for i in range(k):
                index = req.processed + 1 + i  # draft i predicts token x_{T+1+i}
                correct = truth[index] if index < len(truth) else 0
                drafts[j, i] = correct if right[i] else (correct + 1) % self.vocab_size
        return drafts
