"""The state kinds of a hybrid model, grouped by what they answer.

Two kinds, two ways a state follows the tokens:

``PositionalState`` (``KVCache``: the target's full-attention layers and the MTP head's own
cache) is written row by row at the tokens' positions. Rolling it back needs nothing: rows
past the accepted prefix are dead (the attention mask hides them, the next write overwrites
them), so it has no snapshot and no restore.

    feeds(rows)                               graph inputs for these batch rows
    write(outputs, rows, positions, counts)   write the first counts[j] new rows at their positions
    buffers                                   the arrays it keeps (a fork copies rows of them)

``ReplacedState`` (``LayerState``: a GDN layer's conv tail or its fp32 recurrent state S) is
replaced whole by each forward, so it is what a rollback saves and puts back.

    feeds(rows)
    advance(outputs, rows)                    keep the state after a forward's last row
    window(outputs, width)                    a windowed forward's state after each of its rows
    select_window(window, rows, index)        keep window[index[j]][j]: the state after row index[j]
    capture(rows) / put(data, rows)           copy out and put back (StateSet checks the lengths)
    zero(rows)                                a fresh sequence

A select verify hands over its GDN layers in one of two shapes (manifest.GDN_VERIFY_FORMS): the
state after each row (windows, ``select_window``), or the rows' transition record
(``record_names``), which ``StateSet.select`` replays onto the live states in place for the
accepted rows (``arrays.replay_transitions`` / ``commit_conv_tails``: one native call each per
device), so no state is ever written per row. A state_window verify reads each GDN state as the
last slot of a past window [M, B, ...] (manifest.past_window_name): with ``past_slots`` the live
buffer is the last slot of a [past_slots, B, ...] allocation, and ``feeds`` hands the verify of M
rows the M slots that end at it, a view (the ops read slot M-1 only), so nothing is copied.

``StateSet`` drives all of one model's states together, each kind with its own verbs; it
checks that a snapshot is restored at the length it was taken (rollback fails loudly), and
forks a row into others (``fork``: n > 1 continuations of one prefilled prompt).
Buffers live where the ``arrays`` backend keeps them (numpy on the CPU, native device memory
on CUDA), are allocated once and zeroed (stale but finite KV slots are harmless: the
attention mask gives them probability exactly 0, and 0 * finite = 0). On the CPU a forward
over IOBinding (``host_binding``) reads the states where they live and writes a decode's GDN
states into a spare buffer that ``flip`` makes live (``LayerState``), so a step copies only
its new KV rows.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from ..errors import OrtspecError
from ..manifest import past_window_name, record_names, window_row_name
from .kv_window import window_slots
from .row_slots import Rows, RowSlots


class StateError(OrtspecError, RuntimeError):
    """A state operation was misused (e.g. restoring a snapshot taken at another length)."""


@dataclasses.dataclass
class Snapshot:
    """The replaced-whole states of some rows at some lengths (positional states need none)."""

    rows: np.ndarray  # int64 [B] batch rows it was taken of
    lengths: np.ndarray  # int64 [B] tokens processed per row when taken
    data: dict  # buffer name -> copy of those rows


class PositionalState(Protocol):
    """Written at the tokens' positions; dead rows past the accepted prefix cost no rollback."""

    names: tuple[str, ...]
    arrays: object
    buffers: tuple

    def feeds(self, rows: Rows, window: int | None = None) -> dict: ...
    def write(self, outputs: dict, rows: Rows, positions: np.ndarray, counts: np.ndarray | None = None) -> None: ...
    def row_view(self, row: int, length: int) -> dict[str, np.ndarray]: ...


class ReplacedState(Protocol):
    """Replaced whole by each forward: ``out_name`` holds the state after a forward's last row,
    ``window_name`` [M, B, ...] the state after each row of a windowed forward (or, from the CPU
    variants, one output per row: ``window``)."""

    names: tuple[str, ...]
    arrays: object
    buffer: object
    kind: str  # "conv" or "recurrent" (manifest state kinds)
    buffers: tuple
    out_name: str
    window_name: str
    record_names: tuple[str, ...]  # a transition verify's outputs that commit this state

    def feeds(self, rows: Rows, window: int | None = None) -> dict: ...
    def advance(self, outputs: dict, rows: Rows) -> None: ...
    def window(self, outputs: dict, width: int): ...
    def select_window(self, window, rows: Rows, index: np.ndarray) -> None: ...
    def capture(self, rows: Rows) -> dict: ...
    def put(self, data: dict, rows: Rows) -> None: ...
    def zero(self, rows: Rows) -> None: ...
    def row_view(self, row: int, length: int) -> dict[str, np.ndarray]: ...


class KVCache:
    """Static [B, kvh, hd, L] key (transposed) and [B, kvh, L, hd] value buffers, written in place.

    A forward returns its new rows (``new_key.*`` [B, kvh, hd, M], ``new_value.*`` [B, kvh, M, hd]);
    ``write`` puts them at their positions. Rows past the accepted prefix are dead: the mask
    hides them and the next write overwrites them, so a commit writes just the accepted rows.

    Host buffers hold only their first ``slots`` positions ([B, kvh, hd, slots] / [B, kvh, slots,
    hd]; ``fit`` lays them out again when the slots a forward needs change): a forward's window
    is then the buffers' rows themselves, which ONNX Runtime reads in place, where the first W
    slots of [.., L] buffers are strided and every Run copied them (4 caches x 100 KB per row at
    W = 192). Slots past a row's positions are masked (exact zeros), so feeding more slots than a
    forward's window changes time, not bits.
    """

    def __init__(self, arrays, key_name: str, value_name: str, key_shape, value_shape) -> None:
        self.arrays = arrays
        self.names = (key_name, value_name)
        self.key = arrays.zeros(key_shape)
        self.value = arrays.zeros(value_shape)
        self.length = int(key_shape[3])  # L: max_length
        self._storage = (self.key, self.value)  # the [.., L] buffers: every host layout (fit) lives in their memory
        self._layouts = {self.length: self._storage}
        self._new = ("new_" + key_name, "new_" + value_name)

    @property
    def buffers(self) -> tuple:
        return (self.key, self.value)

    @property
    def slots(self) -> int:
        """The positions the buffers hold (L, or fewer on the host: ``fit``)."""
        return self.key.shape[3]

    def fit(self, slots: int) -> None:
        """(host buffers) Lays the buffers out for their first ``slots`` positions, keeping the
        entries below min(slots, self.slots); new slots are zeros (masked, finite: 0 x finite = 0).
        Each layout is a view of the start of the same [B, kvh, hd, L] memory, made once per
        ``slots``: a forward bound to one (``host_binding``) stays valid whenever it comes back."""
        if slots == self.slots:
            return
        keep = min(slots, self.slots)
        old_key, old_value = self.key[..., :keep].copy(), self.value[:, :, :keep].copy()  # the layouts overlap
        if slots not in self._layouts:
            key, value = self._storage
            self._layouts[slots] = (key.reshape(-1)[: key.size // self.length * slots].reshape(*key.shape[:3], slots),
                                    value.reshape(-1)[: value.size // self.length * slots].reshape(
                                        *value.shape[:2], slots, value.shape[3]))
        self.key, self.value = self._layouts[slots]
        self.key[..., :keep], self.key[..., keep:] = old_key, 0
        self.value[:, :, :keep], self.value[:, :, keep:] = old_value, 0

    def feeds(self, rows: Rows, window: int | None = None) -> dict:
        """These rows of the caches: contiguous rows a view (read in place), a subset (the CPU, once
        a request in the middle finished) a gathered copy of those rows. window: the slots the
        forward needs, which the buffers hold (``StateSet.feeds`` fits them first)."""
        if window is not None and window > self.slots:
            raise StateError(f"a forward needs {window} KV slots of {self.names[0]}, which holds {self.slots}; "
                             "StateSet.feeds fits the caches first")
        return {self.names[0]: rows.take(self.arrays, self.key), self.names[1]: rows.take(self.arrays, self.value)}

    def write(self, outputs: dict, rows: Rows, positions: np.ndarray, counts: np.ndarray | None = None) -> None:
        """Writes the first counts[j] new rows of batch row j (all rows when counts is None)."""
        new_key, new_value = outputs[self._new[0]], outputs[self._new[1]]  # [B,kvh,hd,M], [B,kvh,M,hd]
        if rows.slice is not None:
            self._write(rows.slice.start, rows.slice.stop, new_key, new_value, positions, counts)
            return
        for j, row in enumerate(rows.indices.tolist()):  # a subset of rows (CPU): one row at a time
            self._write(row, row + 1, new_key[j: j + 1], new_value[j: j + 1], positions[j: j + 1],
                        None if counts is None else counts[j: j + 1])

    def _write(self, start: int, stop: int, new_key, new_value, positions, counts) -> None:
        """Batch rows start..stop take their new rows (through a view of those rows: no Rows object
        per row, which a subset's every step made for every cache)."""
        self.arrays.write_rows(self.arrays.rows(self.key, start, stop), new_key, positions, counts, axis=3)
        self.arrays.write_rows(self.arrays.rows(self.value, start, stop), new_value, positions, counts, axis=2)

    def row_view(self, row: int, length: int) -> dict[str, np.ndarray]:
        """The live entries of one row (positions < length), as host copies."""
        key = self.arrays.download(self.arrays.rows(self.key, row, row + 1))[0]
        value = self.arrays.download(self.arrays.rows(self.value, row, row + 1))[0]
        return {self.names[0]: key[:, :, :length], self.names[1]: value[:, :length, :]}


class LayerState:
    """A GDN state a forward replaces whole: the conv tail [B, K-1, C] or recurrent S [B, nv, dk, dv].

    The plain graphs return ``{kind}_out.{i}`` (state after the last row); the select verify
    graphs return ``{kind}_window.{i}`` [M, B, ...] (state after each row), or in their CPU
    variants ``{kind}_window.{i}.{j}`` [B, ...] per row j; ``select_window`` copies slot index[j]
    of row j into the live buffer. A transition verify returns ``record_names`` instead (module
    docstring), which ``StateSet.select`` replays.

    Host states are double-buffered: a forward run over IOBinding (``host_binding``) writes
    ``out_name`` straight into ``spare``, and ``flip`` makes that the live buffer, so the state
    after a decode is never copied (it was 0.5 MB per row per step, 12 copies). ``StateSet``
    keeps the spare's other rows in step (``StateSet.flip``).
    """

    def __init__(self, arrays, name: str, shape, past_slots: int = 0) -> None:
        """past_slots: the widest past window a state_window verify reads (K+1); 0: none."""
        self.arrays = arrays
        self.kind, layer = name.split(".")
        self.names = (name,)
        if past_slots:  # the live state is the last slot; the slots before it are never read
            self._backing = arrays.zeros([past_slots, *shape])
            self.buffer = arrays.slot(self._backing, past_slots - 1)
        else:
            self.buffer = arrays.zeros(shape)
        self.spare = arrays.zeros(shape) if arrays.device == "cpu" and not past_slots else None  # flip
        self.past_slots = past_slots
        self.out_name, self.window_name = f"{self.kind}_out.{layer}", f"{self.kind}_window.{layer}"
        self.record_names = record_names(name)
        self._row_names: list[str] = []  # window_row_name(window_name, j), made once

    @property
    def buffers(self) -> tuple:
        return (self.buffer,)

    def flip(self) -> None:
        """The spare, where a bound forward wrote the state after it, becomes the live buffer."""
        self.buffer, self.spare = self.spare, self.buffer

    def window(self, outputs: dict, width: int):
        """The state after each of a windowed forward's ``width`` rows: the stacked [M, B, ...]
        output, or (CPU variants) the list of M per-row outputs [B, ...]; either is indexed
        window[j][b]."""
        if self.window_name in outputs:
            return outputs[self.window_name]
        while len(self._row_names) < width:
            self._row_names.append(window_row_name(self.window_name, len(self._row_names)))
        return [outputs[name] for name in self._row_names[:width]]

    def feeds(self, rows: Rows, window: int | None = None) -> dict:
        """The state's rows, and with past_slots its past windows of 2..past_slots rows ending at them."""
        feeds = {self.names[0]: rows.take(self.arrays, self.buffer)}
        if self.past_slots:
            if rows.slice is None:
                raise StateError("a state_window verify reads contiguous rows only (it runs on CUDA)")
            for width in range(2, self.past_slots + 1):
                feeds[past_window_name(self.names[0], width)] = self.arrays.past_window(
                    self._backing, rows.slice.start, rows.slice.stop, width)
        return feeds

    def advance(self, outputs, rows: Rows) -> None:
        rows.put(self.arrays, self.buffer, outputs[self.out_name])

    def select_window(self, window, rows: Rows, index: np.ndarray) -> None:
        """Row j of the live state takes window[index[j]][j] (``window``)."""
        if rows.slice is not None:
            self.arrays.select(window, index, rows.take(self.arrays, self.buffer))
            return
        for j, row in enumerate(rows.indices):  # a subset of rows (CPU)
            self.buffer[row] = window[index[j]][j]

    def capture(self, rows: Rows) -> dict:
        return {self.names[0]: self.arrays.clone(rows.take(self.arrays, self.buffer))}

    def put(self, data: dict, rows: Rows) -> None:
        rows.put(self.arrays, self.buffer, data[self.names[0]])

    def zero(self, rows: Rows) -> None:
        """A new sequence starts from zero states (any rows on the CPU: their slots may be any)."""
        if rows.slice is not None:
            self.arrays.zero(rows.take(self.arrays, self.buffer))
        else:
            self.buffer[rows.indices] = 0

    def row_view(self, row: int, length: int) -> dict[str, np.ndarray]:
        return {self.names[0]: self.arrays.download(self.arrays.rows(self.buffer, row, row + 1))[0]}


class StateSet:
    """All states of one model (target or MTP), driven together: ``caches`` (positional) and
    ``layers`` (replaced whole), each list answering its own verbs."""

    def __init__(self, arrays_for, table: dict[str, dict], batch: int, kinds: tuple[str, ...],
                 past_slots: int = 0) -> None:
        """arrays_for(state name) -> the arrays backend of the device that holds it; kinds: the
        manifest state kinds this model owns; past_slots: the GDN states' past windows (LayerState)."""
        self.caches: list[PositionalState] = []
        self.layers: list[ReplacedState] = []
        for name, entry in table.items():
            if entry["kind"] not in kinds:
                continue
            shape = [batch] + entry["shape"][1:]
            if entry["kind"] in ("kv_key", "mtp_kv_key"):
                value_name = "value." + name.split(".", 1)[1]
                self.caches.append(KVCache(arrays_for(name), name, value_name, shape,
                                           [batch] + table[value_name]["shape"][1:]))
            elif entry["kind"] in ("conv", "recurrent"):
                self.layers.append(LayerState(arrays_for(name), name, shape, past_slots))
        # host caches hold the slots the forwards need (KVCache.fit): per row the slots written since
        # its sequence began (1 + its last position), which a refit must keep
        self._host_caches = bool(self.caches) and self.caches[0].arrays.device == "cpu"
        self._filled = [0] * batch
        # double-buffered GDN states (host: LayerState.spare): the rows where the spare holds the
        # live state too, and how many flips so far (the views below are made per buffer)
        self.double_buffered = bool(self.layers) and all(s.spare is not None for s in self.layers)
        self._synced = [True] * batch
        self.flips = 0
        # which slot of the buffers holds each row (row_slots): on the host a forward's rows are moved
        # into consecutive slots; every verb takes rows as callers name them, and the per-row
        # bookkeeping here (_filled, _synced) is by slot, in Python lists: a step reads and writes a
        # few of their ints, cheaper in Python than as numpy operations on a few elements
        self.placement = RowSlots(batch)
        self._host = all(kind.arrays.device == "cpu" for kind in self.kinds)
        groups: dict = {}
        for layer in self.layers:
            groups.setdefault(id(layer.arrays), (layer.arrays, []))[1].append(layer)
        self._layers_by_device = list(groups.values())
        # contiguous slots (start, stop, live GDN buffer[, KV layout]) -> the feeds (views of whole
        # buffers, the KV caches as fitted) and the layer buffers' views per device: the same objects
        # every step (the buffers and layouts live as long as this set), made once instead of ~2 per
        # state per step on the host's critical path
        self._feeds: dict[tuple, dict] = {}
        self._layer_views: dict[tuple[int, int], list] = {}

    @property
    def kinds(self) -> list:
        """Every state of the set (caches, then layers)."""
        return [*self.caches, *self.layers]

    def feeds(self, rows: Rows, window: int | None = None) -> dict:
        """Every state's graph input for these rows (a new dict each call: callers may add to it).
        window: the KV slots the forward needs (None: all max_length). On the host the rows are
        first moved into consecutive slots (``RowSlots``), so the feeds are views."""
        rows = self.place(rows, window)
        key = self._binding_key(rows) if rows.slice is not None else None
        feeds = self._feeds.get(key) if key else None
        if feeds is None:
            feeds = {}
            for kind in self.kinds:
                feeds.update(kind.feeds(rows, window))
            if key:
                self._feeds[key] = feeds
        return dict(feeds)

    def place(self, rows: Rows, window: int | None = None) -> Rows:
        """What a forward over these rows needs before it reads the states, whether or not it is
        fed them again (``TargetModel.bound_forward`` binds them once): on the host the rows moved
        into consecutive slots and the caches laid out for its window. Returns the rows' slots."""
        rows = self._place(rows)
        if self._host_caches:
            self._fit_caches(window)
        return rows

    def _place(self, rows: Rows) -> Rows:
        """(host) The slots of these rows, after moving them into consecutive slots in their order:
        every state's rows swapped, as the map was (``RowSlots.place``)."""
        if self._host:
            for a, b in self.placement.place(rows):
                for kind in self.kinds:
                    for buffer in kind.buffers:
                        buffer[[a, b]] = buffer[[b, a]]
                self._filled[a], self._filled[b] = self._filled[b], self._filled[a]
                self._synced[a] = self._synced[b] = False  # the spares' rows stay where they were
        return self.placement.slots(rows)

    def fit(self, window: int | None) -> None:
        """Lays host caches out for a forward over ``window`` KV slots (``feeds`` does before a Run;
        a prefill run apart, ``TargetModel.commit_prefill``, before its rows are written, since
        the steps meanwhile may have laid them out for their own windows)."""
        if self._host_caches:
            self._fit_caches(window)

    def _fit_caches(self, window: int | None) -> None:
        """(host caches) Lays the caches out for this forward's window, or for the slots some row has
        written past it: the first multiple of WINDOW_STEP holding both (all max_length for None)."""
        length = self.caches[0].length
        slots = length if window is None else max(window, window_slots(length, max(self._filled) - 1, 1))
        if slots != self.caches[0].slots:
            for cache in self.caches:
                cache.fit(slots)

    def advance(self, outputs, rows: Rows, positions: np.ndarray) -> None:
        """Keep everything a forward over positions [B, M] left: all M KV rows, the GDN states after row M-1."""
        self._advance(outputs, self.placement.slots(rows), positions)

    def _advance(self, outputs, rows: Rows, positions: np.ndarray) -> None:
        """advance over the slots ``rows``."""
        self._write(outputs, rows, positions)
        self._unsync(rows)
        if rows.slice is None:
            for layer in self.layers:
                layer.advance(outputs, rows)
            return
        for (arrays, layers), views in zip(self._layers_by_device, self._views_of(rows)):
            arrays.copy_many(views, [outputs[s.out_name] for s in layers])

    def binding_key(self, rows: Rows) -> tuple:
        """(contiguous rows) What fixes the buffers a forward over these rows binds (``host_binding``):
        the rows' slots, which of the two GDN buffers is live, and the layout of the KV caches (each
        layout is the same memory, ``KVCache.fit``)."""
        return self._binding_key(self.placement.slots(rows))

    def _binding_key(self, slots: Rows) -> tuple:
        return slots.slice.start, slots.slice.stop, self.flips % 2, self.caches[0].slots if self.caches else None

    def spare_outputs(self, rows: Rows) -> dict:
        """(double-buffered, contiguous rows) Where a bound forward writes each GDN layer's state
        after it (``out_name``): these rows of the spare buffers, views, which ``flip`` makes live."""
        rows = self.placement.slots(rows)
        return {s.out_name: rows.take(s.arrays, s.spare) for s in self.layers}

    def flip(self, rows: Rows, positions: np.ndarray, outputs: dict) -> None:
        """After a bound forward over these rows (positions [B, M]) wrote its GDN states into the
        spare rows (``spare_outputs``): its KV rows written, every spare made live. The other rows
        of each spare first take the live state where it differs, so every row stays live."""
        rows = self.placement.slots(rows)
        if not self.double_buffered:  # nothing was bound to a spare: keep the states as advance does
            self._advance(outputs, rows, positions)
            return
        self._write(outputs, rows, positions)
        start, stop, synced = rows.slice.start, rows.slice.stop, self._synced
        if not (all(synced[:start]) and all(synced[stop:])):  # slots another forward changed since
            for row, in_sync in enumerate(synced):
                if not in_sync and not start <= row < stop:
                    for layer in self.layers:
                        np.copyto(layer.spare[row], layer.buffer[row])
        for layer in self.layers:
            layer.flip()
        # the spare now holds these rows' states before the forward, and every other row's
        self._synced = [not start <= row < stop for row in range(len(synced))]
        self.flips += 1

    def _views_of(self, rows: Rows) -> list[list]:
        """(contiguous rows) Per device group, the views of these rows of each layer's buffer."""
        key = (rows.slice.start, rows.slice.stop, self.flips % 2)
        views = self._layer_views.get(key)
        if views is None:
            views = self._layer_views[key] = [[rows.take(arrays, s.buffer) for s in layers]
                                              for arrays, layers in self._layers_by_device]
        return views

    def select(self, outputs, rows: Rows, positions: np.ndarray, accepted, counts=None) -> None:
        """Keep the state after row accepted[j] of a windowed forward: KV rows 0..a, GDN window slot a
        (or, from a transition verify, its rows 0..a replayed onto the GDN states: ``_replay``).
        counts: accepted + 1, where the caller has it already (a device buffer: the loop that runs
        ahead of the GPU never has the accept lengths on the host; ``runtime.fused_run``)."""
        counts = accepted + 1 if counts is None else counts
        rows = self.placement.slots(rows)
        self._write(outputs, rows, positions, counts=counts)
        self._unsync(rows)
        if self.layers and self.layers[0].record_names[0] in outputs:
            self._replay(outputs, rows, counts)
            return
        width = positions.shape[1]
        if rows.slice is None:
            for layer in self.layers:
                layer.select_window(layer.window(outputs, width), rows, accepted)
            return
        for (arrays, layers), lives in zip(self._layers_by_device, self._views_of(rows)):  # contiguous rows: one
            arrays.select_many([s.window(outputs, width) for s in layers], accepted, lives)  # call per device

    def _replay(self, outputs, rows: Rows, counts) -> None:
        """A transition verify's commit: each GDN state takes its first counts[j] rows of the record
        (recurrent states by replay_transitions, conv tails by commit_conv_tails), one native call of
        each per device, counts read where they are (a device buffer: nothing waits for the host)."""
        if rows.slice is not None:
            for (arrays, layers), views in zip(self._layers_by_device, self._views_of(rows)):
                _replay_layers(arrays, layers, views, outputs.__getitem__, counts)
            return
        for j, row in enumerate(rows.indices.tolist()):  # a subset of rows (CPU): one row at a time
            for arrays, layers in self._layers_by_device:
                _replay_layers(arrays, layers, [s.buffer[row: row + 1] for s in layers],
                               lambda name, j=j: outputs[name][j: j + 1], counts[j: j + 1])

    def write(self, outputs, rows: Rows, positions: np.ndarray, counts: np.ndarray | None = None) -> None:
        """The KV rows only (the MTP head's catch-up: its cache is all it keeps)."""
        self._write(outputs, self.placement.slots(rows), positions, counts)

    def _write(self, outputs, rows: Rows, positions: np.ndarray, counts: np.ndarray | None = None) -> None:
        """write into the slots ``rows``."""
        for cache in self.caches:
            cache.write(outputs, rows, positions, counts)
        if self._host_caches:  # a row's positions are consecutive: its last one is its largest, and
            filled = self._filled  # the slots past an accepted prefix are kept too (dead, harmless)
            for slot, last in zip(rows.ints, positions[:, -1].tolist()):
                filled[slot] = max(filled[slot], last + 1)

    def _unsync(self, slots: Rows) -> None:
        """These slots' spares no longer hold their live states (a forward or a commit changed them)."""
        for slot in slots.ints:
            self._synced[slot] = False

    def reset(self, rows: Rows) -> None:
        """Zero GDN states for new requests in these rows (stale KV slots are masked, no need; they are
        no longer kept by a refit of the host caches)."""
        rows = self.placement.slots(rows)
        for layer in self.layers:
            layer.zero(rows)
        for slot in rows.ints:
            self._filled[slot] = 0
        self._unsync(rows)

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
        rows = self.placement.slots(rows)
        for layer in self.layers:
            layer.put(snap.data, rows)
        self._unsync(rows)

    def capture(self, rows: Rows) -> dict:
        """Copies of the replaced-whole states (GDN) of these rows; KV needs none (positions)."""
        rows, data = self.placement.slots(rows), {}
        for layer in self.layers:
            data.update(layer.capture(rows))
        return data

    def fork(self, src_row: int, dst_rows: Rows) -> None:
        """Every state of batch row src_row copied into each of dst_rows: the n > 1 continuations of
        one prompt, prefilled once in src_row, start from equal states. Whole rows are copied (one
        contiguous copy per state and row, in one call per device): KV slots past the prompt are
        dead in the copies as they are in src_row (masked; the next write overwrites them)."""
        src_row, dst_rows = self.placement.slot(src_row), self.placement.slots(dst_rows)
        for kind in self.kinds:
            self.copy_rows(kind.arrays, list(kind.buffers), src_row, dst_rows)
        for slot in dst_rows.ints:
            self._filled[slot] = self._filled[src_row]
        self._unsync(dst_rows)

    @staticmethod
    def copy_rows(arrays, buffers: list, src_row: int, dst_rows: Rows) -> None:
        """buffers[b][dst] = buffers[b][src_row] for every dst of dst_rows (any buffer [batch, ...])."""
        dsts = [arrays.rows(buffer, int(dst), int(dst) + 1) for buffer in buffers for dst in dst_rows.indices]
        srcs = [arrays.rows(buffer, src_row, src_row + 1) for buffer in buffers for _ in dst_rows.indices]
        arrays.copy_many(dsts, srcs)

    def select_captured(self, captures: list[dict], index: np.ndarray, rows: Rows) -> None:
        """Row j takes its GDN states from captures[index[j]]."""
        rows = self.placement.slots(rows)
        self._unsync(rows)
        for layer in self.layers:
            name = layer.names[0]
            layer.select_window(layer.arrays.stack([c[name] for c in captures]), rows, index)

    def release(self) -> None:
        """Drops every buffer (Session.close): memory goes even if a stale holder keeps this set."""
        self.caches, self.layers, self._layers_by_device = [], [], []
        self._feeds, self._layer_views = {}, {}

    def row_state(self, row: int, length: int) -> dict[str, np.ndarray]:
        """Every live entry of one batch row (host copies), for bitwise comparisons in tests."""
        row, out = self.placement.slot(row), {}
        for kind in self.kinds:
            out.update({n: np.array(v) for n, v in kind.row_view(row, length).items()})
        return out


def _replay_layers(arrays, layers: list, lives: list, record, counts) -> None:
    """The replay of one device's GDN layers (``StateSet._replay``): lives[i] the rows of layers[i]'s
    buffer to commit, record(name) the verify output of that name for the same rows."""
    recurrent = [(s, live) for s, live in zip(layers, lives) if s.kind == "recurrent"]
    conv = [(s, live) for s, live in zip(layers, lives) if s.kind == "conv"]
    if recurrent:  # keys, values, decay, beta
        arrays.replay_transitions([live for _, live in recurrent],
                                  *([record(s.record_names[i]) for s, _ in recurrent] for i in range(4)), counts)
    if conv:
        arrays.commit_conv_tails([live for _, live in conv], [record(s.record_names[0]) for s, _ in conv], counts)
