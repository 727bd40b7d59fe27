"""Batch rows (``Rows``), and which slot of the state buffers holds each (``RowSlots``).

A CPU step runs only the unfinished requests, so once a request in the middle of a batch is
done, the rows a forward runs are no longer a range of the buffers, and every state used to be
gathered into a copy before each Run and scattered back after it (a tenth of a step on the
trained model). ``RowSlots`` maps each row (the request's ``row``, what every caller
names) to the slot that holds its states, and moves rows so that the rows of a forward fill
consecutive slots in their order; the forward then reads and writes views of the buffers, and
the moves are paid once, when the rows a run steps change, not on every step.

    slots(rows)    the slots of these rows, a ``Rows`` (contiguous where they are consecutive)
    place(rows)    the swaps (slot a, slot b) that make these rows consecutive, already applied
                   to the map; the owner swaps its buffers' rows the same way (``StateSet``)
"""

from __future__ import annotations

import numpy as np


class Rows:
    """The batch rows one forward touches: a contiguous range (a view), or on the CPU any subset."""

    def __init__(self, indices) -> None:
        self.indices = np.asarray(indices, dtype=np.int64)
        self.ints: list[int] = self.indices.tolist()  # the same, for per-row bookkeeping in Python
        n = len(self.indices)
        first = int(self.indices[0]) if n else 0
        contiguous = n and np.array_equal(self.indices, np.arange(first, first + n))
        self.slice = slice(first, first + n) if contiguous else None

    def __len__(self) -> int:
        return len(self.indices)

    def take(self, arrays, buffer):
        if self.slice is not None:
            return arrays.rows(buffer, self.slice.start, self.slice.stop)
        return buffer[self.indices]  # a gathered copy (CPU only)

    def put(self, arrays, buffer, values) -> None:
        if self.slice is not None:
            arrays.copy(arrays.rows(buffer, self.slice.start, self.slice.stop), values)
        else:
            buffer[self.indices] = values


class RowSlots:
    """The map row -> slot of one StateSet's buffers (module docstring); the identity until a move."""

    def __init__(self, batch: int) -> None:
        self._slot = np.arange(batch)  # row -> slot
        self._row = np.arange(batch)  # slot -> row
        self._moved = False
        self._slots: dict[bytes, Rows] = {}  # rows' indices -> their slots, until the next move

    def slots(self, rows: Rows) -> Rows:
        if not self._moved:
            return rows
        key = rows.indices.tobytes()
        slots = self._slots.get(key)
        if slots is None:
            slots = self._slots[key] = Rows(self._slot[rows.indices])
        return slots

    def slot(self, row: int) -> int:
        return int(self._slot[row])

    def place(self, rows: Rows) -> list[tuple[int, int]]:
        """The swaps that put rows[j] in slot s + j for every j, for the start s that keeps the most
        rows where they are (none when they are consecutive already)."""
        if not self._moved and rows.slice is not None:
            return []
        now = self._slot[rows.indices]
        n, batch = len(now), len(self._slot)
        if n == 0 or np.array_equal(now, np.arange(now[0], now[0] + n)):
            return []
        starts = np.clip(now - np.arange(n), 0, batch - n)
        start = max(set(starts.tolist()), key=lambda s: (int(np.sum(now == s + np.arange(n))), -s))
        swaps = []
        for j, row in enumerate(rows.indices.tolist()):
            a, b = int(self._slot[row]), start + j
            if a != b:
                other = int(self._row[b])
                self._slot[row], self._slot[other] = b, a
                self._row[a], self._row[b] = other, row
                swaps.append((a, b))
        self._moved, self._slots = True, {}
        return swaps
