"""The MTP head's side of the loop: its catch-ups over the target's hidden states, and the entries
that wait for one.

Entry p of the head's cache holds (h_p, x_{p+1}): the target's hidden state at position p and
the token that followed. A catch-up writes entries and, in the same graph run, drafts the next
step's d_1..d_n (``MTPHead.catch_up``; sampled rows draw theirs, ``catch_up_sampled``). A step
that drafts nothing for the next (a plain decode of auto k's k = 0, a prompt whose next step
decodes) leaves its entries here instead (``DeferredEntries``), so greedy does not pay for a
head it does not use; the next catch-up runs the head over all of them at once.
"""

from __future__ import annotations

import numpy as np

from ..runtime.model import MTPHead
from ..runtime.states import Rows
from . import sampler
from .deferred_entries import DeferredEntries


class Head:
    """Catch-ups of one engine's MTP head, and its waiting entries (``deferred``)."""

    def __init__(self, mtp: MTPHead, arrays, pad_lengths: bool) -> None:
        self.mtp = mtp
        self.deferred = DeferredEntries(arrays, pad_lengths=pad_lengths)

    def catch_up(self, rows: Rows, hidden, next_ids, positions, last, requests, drafts: int, graphed=True) -> None:
        """Entries T..T+last[j] of row j from the target's hiddens [B, W, H] at positions [B, W]
        and the tokens that followed (next_ids [B, m]; padded to W, columns past last[j] are
        padding and never written); the head's output at last[j] is the next step's d_1, then
        d_2..d_drafts. Sampled requests' drafts are drawn, and the distributions they came from
        kept for the acceptance. graphed: a fixed-shape run (a step's), replayed on CUDA."""
        width = positions.shape[1]
        if next_ids.shape[1] < width:  # exact mode: the forward ran K_fix+1 rows
            next_ids = np.concatenate([next_ids, np.zeros((len(next_ids), width - next_ids.shape[1]), np.int64)], 1)
        sampling = sampler.draft_inputs(requests, drafts)
        if sampling is None:
            made = self.mtp.catch_up(rows, hidden, next_ids, positions, last, drafts, graphed=graphed)  # [B, d]
            probs = [None] * len(requests)
        else:
            made, probs = self.mtp.catch_up_sampled(rows, hidden, next_ids, positions, last, drafts, sampling,
                                                    graphed=graphed)  # [B, d], [B, d, V]
        for req, row, q in zip(requests, made, probs):
            req.next_drafts, req.draft_probs = row.tolist(), q if req.samples else None

    def defer_prompts(self, requests, rows: Rows, hidden, next_ids: np.ndarray, source=None) -> None:
        """A prefill group's entries 0..n-1 wait (hidden [B, n, H] on its device; source: each
        request's row of it, sampler.pick)."""
        self.deferred.add_prompts(requests, rows, hidden, next_ids, source)

    def defer_step(self, requests, rows: Rows, hidden: np.ndarray, dtype, next_ids, positions) -> None:
        """A plain decode step's entries wait (hidden [B, H] on the host, as read back)."""
        self.deferred.add_host(requests, rows, hidden, dtype, next_ids, positions)

    def catch_up_deferred(self, drafts: int) -> None:
        """The head over every waiting entry: the prompts, one run per range of consecutive rows,
        then the plain decode steps' entries (one run where rows may be padded; entry p follows
        entries 0..p-1)."""
        for requests, rows, hidden, next_ids, positions, last in self.deferred.take_prompts():
            self.catch_up(rows, hidden, next_ids, positions, last, requests, drafts, graphed=False)
        if self.deferred.has_steps:
            for requests, rows, hidden, next_ids, positions, last in self.deferred.take():
                self.catch_up(rows, hidden, next_ids, positions, last, requests, drafts, graphed=False)

    @property
    def waiting(self) -> bool:
        """Whether entries wait (the head's state is then behind the target's)."""
        return bool(self.deferred)
