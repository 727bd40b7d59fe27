"""The state kinds of a hybrid model, each answering the same verbs.

    feeds(rows)                              graph inputs for these batch rows
    advance(outputs, rows, positions)        keep what a forward left: the state after its last row
    select(outputs, rows, positions, accepted)
                                             keep the state after row accepted[j] of a verify
    snapshot(rows, lengths) / restore(snap, lengths)
                                             save and put back; restore checks the lengths match

Kinds: ``KVCache`` (target full-attention layers and the MTP head's own cache) and
``LayerState`` (a GDN layer's conv tail or its fp32 recurrent state S). Buffers are
allocated once per batch, zeroed (stale but finite KV slots are harmless: the attention
mask gives them probability exactly 0, and 0 * finite = 0).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from ..errors import OrtspecError


class StateError(OrtspecError, RuntimeError):
    """A state operation was misused (e.g. restoring a snapshot taken at another length)."""


class Rows:
    """The batch rows one forward touches: a view when they are contiguous, else a gather."""

    def __init__(self, indices) -> None:
        self.indices = np.asarray(indices, dtype=np.int64)
        n = len(self.indices)
        first = int(self.indices[0]) if n else 0
        self.slice = slice(first, first + n) if n and np.array_equal(self.indices, np.arange(first, first + n)) else None

    def __len__(self) -> int:
        return len(self.indices)

    def take(self, buffer: np.ndarray) -> np.ndarray:
        return buffer[self.slice] if self.slice is not None else buffer[self.indices]

    def put(self, buffer: np.ndarray, values: np.ndarray) -> None:
        if self.slice is not None:
            buffer[self.slice] = values
        else:
            buffer[self.indices] = values


@dataclasses.dataclass
class Snapshot:
    rows: np.ndarray  # int64 [B] batch rows it was taken of
    lengths: np.ndarray  # int64 [B] tokens processed per row when taken
    data: dict[str, np.ndarray]  # buffer name -> copy of those rows

    def subset(self, keep: np.ndarray) -> "Snapshot":
        """The snapshot of the rows where keep (bool [B]) is set."""
        return Snapshot(self.rows[keep], self.lengths[keep], {n: v[keep] for n, v in self.data.items()})


class StateKind(Protocol):
    names: tuple[str, ...]

    def feeds(self, rows: Rows) -> dict[str, np.ndarray]: ...
    def advance(self, outputs: dict, rows: Rows, positions: np.ndarray) -> None: ...
    def select(self, outputs: dict, rows: Rows, positions: np.ndarray, accepted: np.ndarray) -> None: ...
    def snapshot(self, rows: Rows) -> dict[str, np.ndarray]: ...
    def restore(self, data: dict[str, np.ndarray], rows: Rows) -> None: ...


class KVCache:
    """Static [B, kvh, hd, L] key (transposed) and [B, kvh, L, hd] value buffers, written in place.

    A forward returns its new rows; they are written at their positions. Rows past the
    accepted prefix are dead: the mask hides them and the next write overwrites them, so
    snapshot/restore carry nothing and ``select`` just writes the accepted rows.
    """

    def __init__(self, key_name: str, value_name: str, key_shape, value_shape) -> None:
        self.names = (key_name, value_name)
        self.key = np.zeros(key_shape, np.float32)
        self.value = np.zeros(value_shape, np.float32)
        self._new = ("new_" + key_name, "new_" + value_name)

    def feeds(self, rows: Rows) -> dict[str, np.ndarray]:
        return {self.names[0]: rows.take(self.key), self.names[1]: rows.take(self.value)}

    def write(self, outputs: dict, rows: Rows, positions: np.ndarray, counts: np.ndarray | None = None) -> None:
        """Writes the first counts[j] new rows of batch row j (all rows when counts is None)."""
        new_key, new_value = outputs[self._new[0]], outputs[self._new[1]]  # [B,kvh,hd,M], [B,kvh,M,hd]
        for j, row in enumerate(rows.indices):
            n = positions.shape[1] if counts is None else int(counts[j])
            pos = positions[j, :n]
            self.key[row][:, :, pos] = new_key[j][:, :, :n]
            self.value[row][:, pos, :] = new_value[j][:, :n, :]

    def advance(self, outputs, rows, positions) -> None:
        self.write(outputs, rows, positions)

    def select(self, outputs, rows, positions, accepted) -> None:
        self.write(outputs, rows, positions, counts=accepted + 1)

    def snapshot(self, rows) -> dict[str, np.ndarray]:
        return {}

    def restore(self, data, rows) -> None:
        pass

    def row_view(self, row: int, length: int) -> dict[str, np.ndarray]:
        """The live entries of one row (positions < length), for state comparisons."""
        return {self.names[0]: self.key[row][:, :, :length], self.names[1]: self.value[row][:, :length, :]}


class LayerState:
    """A GDN state a forward replaces whole: the conv tail [B, K-1, C] or recurrent S [B, nv, dk, dv].

    The plain graphs return ``{kind}_out.{i}`` (state after the last row); the select verify
    graphs return ``{kind}_window.{i}`` [M, B, ...] (state after each row) and ``select``
    copies slot accepted[j] of row j into the live buffer.
    """

    def __init__(self, name: str, shape) -> None:
        kind, layer = name.split(".")
        self.names = (name,)
        self.buffer = np.zeros(shape, np.float32)
        self._out, self._window = f"{kind}_out.{layer}", f"{kind}_window.{layer}"

    def feeds(self, rows: Rows) -> dict[str, np.ndarray]:
        return {self.names[0]: rows.take(self.buffer)}

    def advance(self, outputs, rows, positions) -> None:
        rows.put(self.buffer, outputs[self._out])

    def select(self, outputs, rows, positions, accepted) -> None:
        window = outputs[self._window]  # [M, B, ...]
        rows.put(self.buffer, window[accepted, np.arange(len(rows))])

    def snapshot(self, rows) -> dict[str, np.ndarray]:
        return {self.names[0]: rows.take(self.buffer).copy()}

    def restore(self, data, rows) -> None:
        rows.put(self.buffer, data[self.names[0]])

    def row_view(self, row: int, length: int) -> dict[str, np.ndarray]:
        return {self.names[0]: self.buffer[row]}


class StateSet:
    """All states of one model (target or MTP), driven together."""

    def __init__(self, table: dict[str, dict], batch: int, kinds: tuple[str, ...]) -> None:
        self.kinds: list[StateKind] = []
        entries = {n: e for n, e in table.items() if e["kind"] in kinds}
        for name, entry in entries.items():
            shape = [batch] + entry["shape"][1:]
            if entry["kind"] in ("kv_key", "mtp_kv_key"):
                value_name = "value." + name.split(".", 1)[1]
                self.kinds.append(KVCache(name, value_name, shape, [batch] + table[value_name]["shape"][1:]))
            elif entry["kind"] in ("conv", "recurrent"):
                self.kinds.append(LayerState(name, shape))

    def feeds(self, rows: Rows) -> dict[str, np.ndarray]:
        feeds = {}
        for kind in self.kinds:
            feeds.update(kind.feeds(rows))
        return feeds

    def advance(self, outputs, rows, positions) -> None:
        for kind in self.kinds:
            kind.advance(outputs, rows, positions)

    def select(self, outputs, rows, positions, accepted) -> None:
        for kind in self.kinds:
            kind.select(outputs, rows, positions, accepted)

    def snapshot(self, rows: Rows, lengths: np.ndarray) -> Snapshot:
        data = {}
        for kind in self.kinds:
            data.update(kind.snapshot(rows))
        return Snapshot(rows.indices.copy(), np.array(lengths, np.int64), data)

    def restore(self, snap: Snapshot, rows: Rows, lengths: np.ndarray) -> None:
        if not np.array_equal(snap.rows, rows.indices):
            raise StateError(f"snapshot of rows {snap.rows.tolist()} restored into rows {rows.indices.tolist()}")
        if not np.array_equal(snap.lengths, lengths):
            raise StateError(
                f"snapshot taken at lengths {snap.lengths.tolist()} restored at lengths {np.asarray(lengths).tolist()}; "
                "a snapshot may only be restored at the length it was taken."
            )
        for kind in self.kinds:
            kind.restore(snap.data, rows)

    def row_state(self, row: int, length: int) -> dict[str, np.ndarray]:
        """Every live entry of one batch row (copies), for bitwise comparisons in tests."""
        out = {}
        for kind in self.kinds:
            out.update({n: v.copy() for n, v in kind.row_view(row, length).items()})
        return out
