"""MTP entries left for later: what the head's catch-up would have read on greedy steps of auto k.

When ``num_speculative_tokens="auto"`` chooses k = 0, a step is a plain decode and the MTP head
does not run (that would make k = 0 dearer than greedy). Entry p of the head's cache still has
to exist before the head drafts again, so each such step leaves here, per row, the target's
hidden state at p (on the host), the token that followed (x_{p+1}) and p. The next catch-up
(``Decoder``) runs the head over all of a row's entries at once, the way the prefill's
catch-up runs over a prompt, and then drafts from the last of them.
"""

from __future__ import annotations

import numpy as np

from ..runtime.states import Rows


class DeferredEntries:
    """Per row, the entries of the plain decode steps since the last catch-up, in step order.

    Rows step together, so the rows of the latest step all have the same number of entries: a
    request joins only through a prefill, which catches the others up first (``Decoder``), and
    on the CPU a finished request's row leaves the steps (its entries are dropped)."""

    def __init__(self, arrays) -> None:
        self.arrays = arrays
        self._rows: dict[int, list[tuple[np.ndarray, int, int]]] = {}  # row -> [(hidden [H] host, x_{p+1}, p)]
        self._last: tuple[list, Rows] | None = None  # the latest step's requests and rows
        self._dtype = None  # the hidden states' dtype on their device

    def __bool__(self) -> bool:
        return self._last is not None

    def add(self, requests: list, rows: Rows, hidden, next_ids: np.ndarray, positions: np.ndarray) -> None:
        """One plain decode step: hidden [B, W, H] on its device (row 0 is the step's token),
        next_ids [B], positions [B]. Downloads the hidden rows (the host waits for the step)."""
        self.add_host(requests, rows, self.arrays.download(hidden)[:, 0], hidden.dtype, next_ids, positions)

    def add_host(self, requests: list, rows: Rows, hidden: np.ndarray, dtype, next_ids: np.ndarray,
                 positions: np.ndarray) -> None:
        """One plain decode step whose hidden rows are on the host already: hidden [B, H] as
        ``arrays.download`` gives them (bfloat16: its uint16 bit pattern), dtype: theirs on the
        device. The pipelined loop reads them back a step late (``auto_stretch``)."""
        self._dtype = dtype
        for j, row in enumerate(rows.indices):
            self._rows.setdefault(int(row), []).append((hidden[j], int(next_ids[j]), int(positions[j])))
        self._last = (requests, rows)

    def take(self):
        """Every entry of the latest step's rows, forgetting all: (requests, rows, hidden
        [B, m, H] on the device, next_ids [B, m], positions [B, m], last [B] = m - 1)."""
        requests, rows = self._last
        entries = [self._rows[int(row)] for row in rows.indices]
        m = len(entries[0])
        if any(len(e) != m for e in entries):
            raise RuntimeError(f"deferred MTP entries out of step: {[len(e) for e in entries]} per row")
        hidden = np.stack([np.stack([h for h, _, _ in e]) for e in entries])  # [B, m, H]
        next_ids = np.array([[x for _, x, _ in e] for e in entries], np.int64)  # [B, m]
        positions = np.array([[p for _, _, p in e] for e in entries], np.int64)  # [B, m]
        self._rows, self._last = {}, None
        last = np.full(len(entries), m - 1, np.int64)
        return requests, rows, self.arrays.from_host(hidden, self._dtype), next_ids, positions, last
