"""The state kinds of a hybrid model, each answering the same verbs.

    feeds(rows, window)                      graph inputs for these batch rows (KV: the first
                                             ``window`` slots, or all when None)
    advance(outputs, rows, positions)        keep what a forward left: the state after its last row
    select(outputs, rows, positions, accepted)
                                             keep the state after row accepted[j] of a verify
    snapshot(rows) / restore(data, rows)     save and put back (StateSet checks the lengths)

Kinds: ``KVCache`` (target full-attention layers and the MTP head's own cache) and
``LayerState`` (a GDN layer's conv tail or its fp32 recurrent state S). Buffers live where
the ``arrays`` backend keeps them (numpy on the CPU, native device memory on CUDA), are
allocated once and zeroed (stale but finite KV slots are harmless: the attention mask gives
them probability exactly 0, and 0 * finite = 0).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from ..errors import OrtspecError


class StateError(OrtspecError, RuntimeError):
    """A state operation was misused (e.g. restoring a snapshot taken at another length)."""


class Rows:
    """The batch rows one forward touches: a contiguous range (a view), or on the CPU any subset."""

    def __init__(self, indices) -> None:
        self.indices = np.asarray(indices, dtype=np.int64)
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

    def each(self):
        """(position in this batch, single-row Rows) pairs, for per-row work on a subset."""
        return [(j, Rows([row])) for j, row in enumerate(self.indices)]


@dataclasses.dataclass
class Snapshot:
    rows: np.ndarray  # int64 [B] batch rows it was taken of
    lengths: np.ndarray  # int64 [B] tokens processed per row when taken
    data: dict  # buffer name -> copy of those rows



class StateKind(Protocol):
    names: tuple[str, ...]

    def feeds(self, rows: Rows, window: int | None = None) -> dict: ...
    def advance(self, outputs: dict, rows: Rows, positions: np.ndarray) -> None: ...
    def select(self, outputs: dict, rows: Rows, positions: np.ndarray, accepted: np.ndarray) -> None: ...
    def snapshot(self, rows: Rows) -> dict: ...
    def restore(self, data: dict, rows: Rows) -> None: ...


class KVCache:
    """Static [B, kvh, hd, L] key (transposed) and [B, kvh, L, hd] value buffers, written in place.

    A forward returns its new rows; they are written at their positions. Rows past the
    accepted prefix are dead: the mask hides them and the next write overwrites them, so
    snapshot/restore carry nothing and ``select`` writes just the accepted rows.
    """

    def __init__(self, arrays, key_name: str, value_name: str, key_shape, value_shape) -> None:
        self.arrays = arrays
        self.names = (key_name, value_name)
        self.key = arrays.zeros(key_shape)
        self.value = arrays.zeros(value_shape)
        self._new = ("new_" + key_name, "new_" + value_name)

    def feeds(self, rows: Rows, window: int | None = None) -> dict:
        key, value = rows.take(self.arrays, self.key), rows.take(self.arrays, self.value)
        if window is not None:  # host views; ONNX Runtime copies the first `window` slots
            key, value = key[..., :window], value[:, :, :window]
        return {self.names[0]: key, self.names[1]: value}

    def write(self, outputs: dict, rows: Rows, positions: np.ndarray, counts: np.ndarray | None = None) -> None:
        """Writes the first counts[j] new rows of batch row j (all rows when counts is None)."""
        new_key, new_value = outputs[self._new[0]], outputs[self._new[1]]  # [B,kvh,hd,M], [B,kvh,M,hd]
        if rows.slice is not None:
            self._write(rows, new_key, new_value, positions, counts)
            return
        for j, one in rows.each():  # a subset of rows (CPU): one row at a time
            self._write(one, new_key[j: j + 1], new_value[j: j + 1], positions[j: j + 1],
                        None if counts is None else counts[j: j + 1])

    def _write(self, rows, new_key, new_value, positions, counts) -> None:
        self.arrays.write_rows(rows.take(self.arrays, self.key), new_key, positions, counts, axis=3)
        self.arrays.write_rows(rows.take(self.arrays, self.value), new_value, positions, counts, axis=2)

    def advance(self, outputs, rows, positions) -> None:
        self.write(outputs, rows, positions)

    def select(self, outputs, rows, positions, accepted) -> None:
        self.write(outputs, rows, positions, counts=accepted + 1)

    def snapshot(self, rows) -> dict:
        return {}

    def restore(self, data, rows) -> None:
        pass

    def row_view(self, row: int, length: int) -> dict[str, np.ndarray]:
        """The live entries of one row (positions < length), as host copies."""
        key = self.arrays.download(self.arrays.rows(self.key, row, row + 1))[0]
        value = self.arrays.download(self.arrays.rows(self.value, row, row + 1))[0]
        return {self.names[0]: key[:, :, :length], self.names[1]: value[:, :length, :]}


class LayerState:
    """A GDN state a forward replaces whole: the conv tail [B, K-1, C] or recurrent S [B, nv, dk, dv].

    The plain graphs return ``{kind}_out.{i}`` (state after the last row); the select verify
    graphs return ``{kind}_window.{i}`` [M, B, ...] (state after each row) and ``select``
    copies slot accepted[j] of row j into the live buffer.
    """

    def __init__(self, arrays, name: str, shape) -> None:
        self.arrays = arrays
        kind, layer = name.split(".")
        self.names = (name,)
        self.buffer = arrays.zeros(shape)
        self.out_name, self.window_name = f"{kind}_out.{layer}", f"{kind}_window.{layer}"

    def feeds(self, rows: Rows, window: int | None = None) -> dict:
        return {self.names[0]: rows.take(self.arrays, self.buffer)}

    def advance(self, outputs, rows, positions) -> None:
        rows.put(self.arrays, self.buffer, outputs[self.out_name])

    def select(self, outputs, rows, positions, accepted) -> None:
        self.select_window(outputs[self.window_name], rows, accepted)

    def select_window(self, window, rows: Rows, index: np.ndarray) -> None:
        """Row j of the live state takes window[index[j], j]; window is [W, B, ...]."""
        if rows.slice is not None:
            self.arrays.select(window, index, rows.take(self.arrays, self.buffer))
        else:
            self.buffer[rows.indices] = window[index, np.arange(len(rows))]

    def snapshot(self, rows) -> dict:
        return {self.names[0]: self.arrays.clone(rows.take(self.arrays, self.buffer))}

    def restore(self, data, rows) -> None:
        rows.put(self.arrays, self.buffer, data[self.names[0]])

    def row_view(self, row: int, length: int) -> dict[str, np.ndarray]:
        return {self.names[0]: self.arrays.download(self.arrays.rows(self.buffer, row, row + 1))[0]}


class StateSet:
    """All states of one model (target or MTP), driven together."""

    def __init__(self, arrays_for, table: dict[str, dict], batch: int, kinds: tuple[str, ...]) -> None:
        """arrays_for(state name) -> the arrays backend of the device that holds it."""
        self.kinds: list[StateKind] = []
        for name, entry in table.items():
            if entry["kind"] not in kinds:
                continue
            shape = [batch] + entry["shape"][1:]
            if entry["kind"] in ("kv_key", "mtp_kv_key"):
                value_name = "value." + name.split(".", 1)[1]
                self.kinds.append(KVCache(arrays_for(name), name, value_name, shape,
                                          [batch] + table[value_name]["shape"][1:]))
            elif entry["kind"] in ("conv", "recurrent"):
                self.kinds.append(LayerState(arrays_for(name), name, shape))
        groups: dict = {}
        for kind in self.kinds:
            if isinstance(kind, LayerState):
                groups.setdefault(id(kind.arrays), (kind.arrays, []))[1].append(kind)
        self._layer_groups = list(groups.values())

    def feeds(self, rows: Rows, window: int | None = None) -> dict:
        feeds = {}
        for kind in self.kinds:
            feeds.update(kind.feeds(rows, window))
        return feeds

    def advance(self, outputs, rows, positions) -> None:
        for kind in self._one_by_one(rows):
            kind.advance(outputs, rows, positions)
        for arrays, kinds in self._together(rows):
            arrays.copy_many([rows.take(arrays, k.buffer) for k in kinds], [outputs[k.out_name] for k in kinds])

    def select(self, outputs, rows, positions, accepted) -> None:
        for kind in self._one_by_one(rows):
            kind.select(outputs, rows, positions, accepted)
        for arrays, kinds in self._together(rows):
            arrays.select_many([outputs[k.window_name] for k in kinds], accepted,
                               [rows.take(arrays, k.buffer) for k in kinds])

    def _together(self, rows: Rows) -> list:
        """(arrays, GDN states on it): on contiguous rows a device's GDN states are committed
        in one call (one call per layer was a measured share of a step's host time)."""
        return self._layer_groups if rows.slice is not None else []

    def _one_by_one(self, rows: Rows) -> list:
        return self.kinds if rows.slice is None else [k for k in self.kinds if not isinstance(k, LayerState)]

    def snapshot(self, rows: Rows, lengths: np.ndarray) -> Snapshot:
        return Snapshot(rows.indices.copy(), np.array(lengths, np.int64), self.capture(rows))

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

    def capture(self, rows: Rows) -> dict:
        """Copies of the replaced-whole states (GDN) of these rows; KV needs none (positions)."""
        data = {}
        for kind in self.kinds:
            data.update(kind.snapshot(rows))
        return data

    def select_captured(self, captures: list[dict], index: np.ndarray, rows: Rows) -> None:
        """Row j takes its state from captures[index[j]]."""
        for kind in self.kinds:
            if isinstance(kind, LayerState):
                name = kind.names[0]
                kind.select_window(kind.arrays.stack([c[name] for c in captures]), rows, index)

    def release(self) -> None:
        """Drops every buffer (Session.close): memory goes even if a stale holder keeps this set."""
        self.kinds, self._layer_groups = [], []

    def row_state(self, row: int, length: int) -> dict[str, np.ndarray]:
        """Every live entry of one batch row (host copies), for bitwise comparisons in tests."""
        out = {}
        for kind in self.kinds:
            out.update({n: np.array(v) for n, v in kind.row_view(row, length).items()})
        return out
