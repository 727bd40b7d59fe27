"""Where state and step buffers live, and the few operations the runtime does on them.

``HostArrays`` keeps numpy arrays (CPU). ``CudaArrays`` keeps device memory owned by
ortspec._native (PersistentBuffers) and runs the native kernels; ONNX Runtime sees both
through zero-copy OrtValues (``ortvalue_from_numpy`` / ``OrtValue.from_dlpack``). The
state kinds and the bound graphs are written once against this interface.

Ordering on CUDA: by default ONNX Runtime and ortspec share one stream per device
(``streams.device_stream``, given to every session as ``user_compute_stream``): every native
kernel, upload and download is enqueued on it, so the stream orders the two sides' writes and
``settle()`` has nothing to wait for. With ``ORTSPEC_CUDA_STREAM=legacy`` (``streams.SHARED_STREAM``
false) ONNX Runtime runs on its own stream, our kernels on the legacy stream 0, and ``settle()``
waits for ours before each Run (ONNX Runtime's Run waits for its own stream before returning).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnxruntime as ort

from .._native_loader import load_native
from .streams import SHARED_STREAM, HostReadback, Readback, device_stream

DTYPES = {"float32": np.float32, "int64": np.int64, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


_NAMES: dict = {}


def _dtype_name(dtype) -> str:
    """numpy dtype, type or name -> the native module's dtype name (memoised: a step asks often)."""
    name = _NAMES.get(dtype)
    if name is None:
        bf16 = dtype is ml_dtypes.bfloat16 or str(dtype) == "bfloat16"
        name = _NAMES[dtype] = "bfloat16" if bf16 else np.dtype(dtype).name
    return name


class HostArrays:
    """numpy arrays and numpy operations (the reference semantics of the native kernels)."""

    device = "cpu"

    def __init__(self, device_index: int = 0) -> None:
        self.device_index = device_index  # pipeline stages may name "devices" on the CPU too; one host

    def zeros(self, shape, dtype=np.float32) -> np.ndarray:
        return np.zeros(shape, dtype)

    def ort_value(self, array: np.ndarray) -> ort.OrtValue:
        return ort.OrtValue.ortvalue_from_numpy(array)

    def rows(self, array: np.ndarray, start: int, stop: int) -> np.ndarray:
        return array[start:stop]

    def reshape(self, array: np.ndarray, shape) -> np.ndarray:
        return array.reshape(shape)

    def slot(self, array: np.ndarray, index: int) -> np.ndarray:
        """array[index] of a [W, ...] array, a view."""
        return array[index]

    def past_window(self, backing: np.ndarray, start: int, stop: int, width: int) -> np.ndarray:
        """A [width, stop-start, ...] view of backing [W, B, ...] whose last slot is backing[W-1][start:stop]
        (its other slots: the bytes before, in backing; what a state_window op never reads)."""
        return backing.reshape(-1)[_past_window_span(backing.shape, start, stop, width)].reshape(
            width, stop - start, *backing.shape[2:])

    def upload(self, dst: np.ndarray, host: np.ndarray) -> None:
        np.copyto(dst, host)

    def download(self, array) -> np.ndarray:
        return np.array(array)

    def from_host(self, host: np.ndarray, dtype) -> np.ndarray:
        """host as a graph input on this device, in dtype (what ``download`` gave back goes back)."""
        return host.astype(dtype, copy=False)

    def copy(self, dst, src) -> None:
        np.copyto(dst, src)

    def copy_many(self, dsts: list, srcs: list) -> None:
        for dst, src in zip(dsts, srcs):
            np.copyto(dst, src)

    def zero(self, array) -> None:
        array[...] = 0

    def stack(self, arrays: list) -> np.ndarray:
        return np.stack(arrays)

    def clone(self, src) -> np.ndarray:
        return np.array(src)

    def select(self, window, index: np.ndarray, live) -> None:
        """live[b] = window[index[b]][b]; window [W, B, ...], or W arrays [B, ...] (the CPU graphs'
        per-row states, ``LayerState.window``). One copy per row, straight into live (a gather
        by fancy index made a temporary of every selected state, then copied it again)."""
        for b, slot in enumerate(index.tolist()):
            np.copyto(live[b], window[slot][b])

    def select_many(self, windows: list, index: np.ndarray, lives: list) -> None:
        for window, live in zip(windows, lives):
            self.select(window, index, live)

    def gather(self, src, index: np.ndarray, dst) -> None:
        """dst[b] = src[b, index[b]]; src [B, M, ...]."""
        dst[...] = src[np.arange(len(index)), index]

    def replay_transitions(self, states: list, keys: list, values: list, decay: list, beta: list, counts) -> None:
        """Per layer, each request's first counts[b] verify rows replayed onto its GDN state, in place
        (native replay_transitions, csrc/core/transition_kernels.h): states [B, nv, dk, dv], keys
        [B, M, nk, dk] (k̂), values [B, M, nv*dv], decay (g) and beta [B, M, nv]; for row j and value
        head h (key head h // (nv/nk)): S <- e^g S; u = beta (v - S^T k); S <- S + k u^T. float32,
        requests that still take a row all at once."""
        counts = _checked_counts("replay_transitions", counts, keys[0].shape[1] if keys else 0)
        for state, k, v, g, b in zip(states, keys, values, decay, beta):
            batch, heads, _, value_dim = state.shape
            k = np.repeat(k, heads // k.shape[2], axis=2)  # [B, M, nv, dk]: value head h reads key head h // r
            v = v.reshape(batch, -1, heads, value_dim)  # [B, M, nv, dv]
            for j in range(int(counts.max(initial=0))):
                taking = counts > j  # [B]: the requests that replay row j
                s = state[taking] * np.exp(g[taking, j])[..., None, None]  # [b, nv, dk, dv]
                key = k[taking, j]  # [b, nv, dk]
                u = b[taking, j][..., None] * (v[taking, j] - np.einsum("bhkv,bhk->bhv", s, key))  # [b, nv, dv]
                state[taking] = s + key[..., :, None] * u[..., None, :]

    def commit_conv_tails(self, tails: list, inputs: list, counts) -> None:
        """Per layer, tail[b] <- rows n..n+K-2 of concat(tail[b], inputs[b]), n = counts[b]: the conv
        tail after a verify's first n rows (native commit_conv_tails); tails [B, K-1, C], inputs
        [B, M, C] (the rows' pre-conv q, k, v)."""
        counts = _checked_counts("commit_conv_tails", counts, inputs[0].shape[1] if inputs else 0)
        for tail, fed in zip(tails, inputs):
            joined = np.concatenate([tail, fed], axis=1)  # [B, K-1+M, C]
            for b, n in enumerate(counts.tolist()):
                tail[b] = joined[b, n: n + tail.shape[1]]

    def advance_decode_inputs(self, tokens, ids, positions, last_position: int) -> None:
        """The next decode step's inputs [B, 1]: ids = tokens, positions one on (at most last_position)."""
        ids[...] = tokens
        np.minimum(positions + 1, last_position, out=positions)

    def advance_speculative_inputs(self, step_ids, ids, positions, verified, counts, last_start: int) -> None:
        """From a verify_mtp_k{k} run's step_ids [B, 2k+2] (g_0..g_k | a | d_1..d_k): this step's
        commit, counts [B] = a + 1 at verified [B, k+1] = positions; then the next step's inputs
        in place, ids [B, k+1] = [g_a, d_1..d_k] and positions = min(T + a + 1, last_start) + 0..k.
        Worked out in Python ints: a fused step's first host work after its Run, over a few rows,
        where each numpy operation costs several times what it does warm."""
        k = ids.shape[1] - 1
        rows = step_ids.tolist()
        accepted = [row[k + 1] for row in rows]  # [B]
        if not all(0 <= a <= k for a in accepted):
            raise ValueError(f"advance_speculative_inputs: accept lengths {accepted} outside 0..k={k}; "
                             "nothing was written")
        starts = positions[:, 0].tolist()  # T [B]
        verified[...] = positions
        counts[...] = [a + 1 for a in accepted]
        ids[...] = [[row[a], *row[k + 2:]] for row, a in zip(rows, accepted)]  # the bonus g_a, the drafts
        positions[...] = [[min(t + a + 1, last_start) + j for j in range(k + 1)] for t, a in zip(starts, accepted)]

    def write_rows(self, cache, rows, positions, counts, axis: int) -> None:
        """cache[b, ..., positions[b, j], ...] = rows[b, ..., j, ...] (position axis `axis`), j < counts[b].
        Every forward the runtime runs has consecutive positions per row (T, T+1, ...): each row is
        then one slice assignment, about a third of the time of an assignment through an index array
        (which other positions still take)."""
        lead = (slice(None),) * (axis - 1)
        width = positions.shape[1]
        if width == 1 and counts is None:  # a decode: one row each, where an int index puts it
            for b, start in enumerate(positions[:, 0].tolist()):
                cache[(b, *lead, start)] = rows[(b, *lead, 0)]
            return
        counts = [width] * len(positions) if counts is None else counts.tolist()
        for b, (at, n) in enumerate(zip(positions.tolist(), counts)):  # a step's few rows: checked as ints
            if at == list(range(at[0], at[0] + width)):
                cache[(b, *lead, slice(at[0], at[0] + n))] = rows[(b, *lead, slice(0, n))]
            else:  # cache[b] first: an index array beside the int b would move the indexed axis to the front
                cache[b][(*lead, positions[b, :n])] = rows[b][(*lead, slice(0, n))]

    def staging(self, name: str, shape, dtype) -> np.ndarray:
        """A buffer valid until the next staging() of this name (eager hand-overs between devices)."""
        return np.empty(shape, dtype)

    def settle(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def readback(self, shape, dtype) -> HostReadback:
        return HostReadback()

    def begin_step(self, check_errors: bool = True) -> None:
        pass

    def release(self) -> None:
        pass  # numpy memory goes with its last reference


def _past_window_span(shape, start: int, stop: int, width: int) -> slice:
    """The elements of a past window (HostArrays.past_window) in the flat backing [W, B, ...]."""
    row = int(np.prod(shape[2:]))  # one request's state
    end = ((shape[0] - 1) * shape[1] + stop) * row
    return slice(end - width * (stop - start) * row, end)


def _checked_counts(op: str, counts, rows: int) -> np.ndarray:
    """counts as int64 [B], every one in 0..rows (the native kernels' check: nothing written else)."""
    counts = np.asarray(counts, np.int64)
    bad = np.flatnonzero((counts < 0) | (counts > rows))
    if len(bad):
        raise ValueError(f"{op}: counts[{bad[0]}]={counts[bad[0]]} is out of range 0..M={rows} (the verify's rows); "
                         "nothing was written")
    return counts


class CudaArrays:
    """Device memory and native kernels on one CUDA device, all enqueued on ``stream`` (the
    handle of the stream shared with ONNX Runtime, or 0, the legacy stream; module docstring)."""

    device = "cuda"

    def __init__(self, scratch_bytes: int, device_index: int = 0, shared_stream: bool = SHARED_STREAM) -> None:
        self.native = load_native()
        if not self.native.cuda_available():
            info = self.native.build_info()
            raise RuntimeError(f"ortspec._native has no usable CUDA device: {info.get('cuda_unavailable_reason')}")
        self.device_index = device_index
        self.shared_stream = shared_stream
        self.stream = device_stream(self.native, device_index).handle if shared_stream else 0
        self.pool = self.native.PersistentBuffers("cuda", device_index)  # states, bound I/O: fixed for life
        self.scratch_arena = self.native.StepScopedArena(scratch_bytes, "cuda", device_index)  # reset every step
        self._uploaded: dict = {}  # small host arrays uploaded this step (scratch), by content
        self._staging: dict = {}
        self._persistent: dict = {}  # id -> persistent buffer (held, so an id is never reused)
        self._views: dict = {}  # views of persistent buffers: rows (id, start, stop), slots and windows (id, byte, shape)
        self._ids = 0

    def begin_step(self, check_errors: bool = True) -> None:
        """Per step: report any index error a kernel recorded (this waits for the stream), then
        hand the scratch back. Without check_errors nothing waits: a loop that runs ahead of the
        GPU may reuse scratch at once, because every reader and writer of it is on the stream, in
        order (a shared stream only); it checks the errors when it waits anyway."""
        if check_errors or not self.shared_stream:
            self.native.check_device_errors(self.device_index, self.stream)
        self.scratch_arena.reset()
        self._uploaded = {}

    def scratch(self, shape, dtype):
        return self.scratch_arena.allocate(tuple(int(s) for s in shape), _dtype_name(dtype))

    def zeros(self, shape, dtype=np.float32):
        self._ids += 1
        buf = self.pool.allocate(f"b{self._ids}", tuple(int(s) for s in shape), _dtype_name(dtype))
        buf.zero_(self.stream)
        self._persistent[id(buf)] = buf
        return buf

    def ort_value(self, buffer) -> ort.OrtValue:
        return ort.OrtValue.from_dlpack(buffer.__dlpack__())

    def rows(self, buffer, start: int, stop: int):
        """A view of rows start..stop. Views of persistent buffers (fixed for life) are made
        once: a step takes the same rows of every state several times."""
        key = (id(buffer), start, stop)
        view = self._views.get(key)
        if view is None:
            row_bytes = buffer.nbytes // buffer.shape[0]
            view = self.native.Buffer.from_pointer(buffer.data_ptr + start * row_bytes,
                                                   (stop - start,) + tuple(buffer.shape[1:]), buffer.dtype,
                                                   "cuda", self.device_index)
            if id(buffer) in self._persistent:
                self._views[key] = view
        return view

    def reshape(self, buffer, shape):
        return self.native.Buffer.from_pointer(buffer.data_ptr, tuple(shape), buffer.dtype, "cuda", self.device_index)

    def slot(self, buffer, index: int):
        """buffer[index] of a persistent [W, ...] buffer: a view, persistent itself (its row views are made once)."""
        view = self._view(buffer, index * (buffer.nbytes // buffer.shape[0]), tuple(buffer.shape[1:]))
        self._persistent[id(view)] = view
        return view

    def past_window(self, backing, start: int, stop: int, width: int):
        """HostArrays.past_window on the device: a view, made once per (backing, rows, width)."""
        span = _past_window_span(tuple(backing.shape), start, stop, width)
        itemsize = np.dtype(DTYPES[backing.dtype]).itemsize
        return self._view(backing, itemsize * span.start, (width, stop - start, *backing.shape[2:]))

    def _view(self, buffer, offset: int, shape: tuple):
        """The view of `shape` at byte `offset` of a persistent buffer (its dtype), made once."""
        key = (id(buffer), offset, shape)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self.native.Buffer.from_pointer(buffer.data_ptr + offset, shape, buffer.dtype,
                                                                      "cuda", self.device_index)
        return view

    def upload(self, dst, host: np.ndarray) -> None:
        if dst.dtype == "bfloat16":  # the native module takes bfloat16 as its uint16 bit pattern
            dst.copy_from_numpy(np.ascontiguousarray(host).view(np.uint16), self.stream)
            return
        dst.copy_from_numpy(np.ascontiguousarray(host, DTYPES[dst.dtype]), self.stream)

    def download(self, buffer) -> np.ndarray:
        """A host copy; waits for the stream (so for everything enqueued before)."""
        return buffer.to_numpy(self.stream)

    def readback(self, shape, dtype) -> Readback:
        """A host copy of a [shape] buffer made without waiting (``streams.Readback``)."""
        return Readback(self.native, self.stream, self.device_index, shape, _dtype_name(dtype))

    def from_host(self, host: np.ndarray, dtype):
        """host as a step-scratch device buffer of dtype (bfloat16: host holds its uint16 bit
        pattern, as ``download`` gives it)."""
        buffer = self.scratch(host.shape, dtype)
        self.upload(buffer, host)
        return buffer

    def wrap(self, value: ort.OrtValue):
        return self.native.Buffer.from_pointer(value.data_ptr(), tuple(value.shape()),
                                               {"tensor(float)": "float32", "tensor(int64)": "int64",
                                                "tensor(float16)": "float16",
                                                "tensor(bfloat16)": "bfloat16"}[value.data_type()],
                                               "cuda", self.device_index)

    def copy(self, dst, src) -> None:
        self.native.copy_buffer(dst, src, self.stream)

    def copy_many(self, dsts: list, srcs: list) -> None:
        """Every pair in one native call (validated first)."""
        self.native.copy_buffers(dsts, srcs, self.stream)

    def zero(self, buffer) -> None:
        buffer.zero_(self.stream)

    def stack(self, buffers: list):
        """[W, ...] scratch holding the buffers in order (copies)."""
        window = self.scratch((len(buffers),) + tuple(buffers[0].shape), DTYPES[buffers[0].dtype])
        for i, buffer in enumerate(buffers):
            self.copy(self.reshape(self.rows(window, i, i + 1), buffer.shape), buffer)
        return window

    def clone(self, src):
        out = self.scratch(src.shape, DTYPES[src.dtype])
        self.native.copy_buffer(out, src, self.stream)
        return out

    def _index(self, index):
        """A device copy of a small int64 host array, uploaded once per step per content
        (every attention layer and the MTP head write KV rows at the same positions); a device
        buffer (a captured slot's static positions) as it is."""
        if not isinstance(index, np.ndarray):
            return index
        host = np.ascontiguousarray(index, np.int64)
        key = (host.shape, host.tobytes())
        buf = self._uploaded.get(key)
        if buf is None:
            buf = self._uploaded[key] = self.scratch_arena.allocate(host.shape, "int64")
            buf.copy_from_numpy(host, self.stream)
        return buf

    def select(self, window, index: np.ndarray, live) -> None:
        self.native.select_slots(window, self._index(index), live, self.stream)

    def select_many(self, windows: list, index: np.ndarray, lives: list) -> None:
        self.native.select_slots_many(windows, self._index(index), lives, self.stream)

    def gather(self, src, index: np.ndarray, dst) -> None:
        self.native.gather_rows(src, self._index(index), dst, self.stream)

    def replay_transitions(self, states: list, keys: list, values: list, decay: list, beta: list, counts) -> None:
        """Every layer in one launch; counts a host array (uploaded) or a device buffer (as it is)."""
        self.native.replay_transitions(states, keys, values, decay, beta, self._index(counts), self.stream)

    def commit_conv_tails(self, tails: list, inputs: list, counts) -> None:
        self.native.commit_conv_tails(tails, inputs, self._index(counts), self.stream)

    def advance_decode_inputs(self, tokens, ids, positions, last_position: int) -> None:
        self.native.advance_decode_inputs(tokens, ids, positions, last_position, self.stream)

    def advance_speculative_inputs(self, step_ids, ids, positions, verified, counts, last_start: int) -> None:
        self.native.advance_speculative_inputs(step_ids, ids, positions, verified, counts, last_start, self.stream)

    def write_rows(self, cache, rows, positions, counts, axis: int) -> None:
        positions = self._index(positions)
        counts = None if counts is None else self._index(counts)
        self.native.write_rows(cache, rows, positions, counts, axis=axis, stream=self.stream)

    def staging(self, name: str, shape, dtype):
        """A buffer valid until the next staging() of this name (eager hand-overs between
        devices, of any shape): a view on one persistent buffer per name that grows as needed."""
        nbytes = int(np.prod(shape)) * (2 if _dtype_name(dtype) == "bfloat16" else np.dtype(dtype).itemsize)
        held = self._staging.get(name)
        if held is None or held.nbytes < nbytes:  # int64 words: the native buffers hold no bytes
            words = -(-max(nbytes, 2 * (held.nbytes if held else 0)) // 8)
            held = self._staging[name] = self.zeros([words], np.int64)
        return self.native.Buffer.from_pointer(held.data_ptr, tuple(int(s) for s in shape), _dtype_name(dtype),
                                               "cuda", self.device_index)

    def release(self) -> None:
        """Drops this device's buffer pool, scratch arena and every buffer held here (Session.close);
        device memory is freed once no engine or captured slot holds a buffer either."""
        self.synchronize()
        self._persistent.clear()
        self._views.clear()
        self._staging.clear()
        self._uploaded = {}
        self.pool = self.scratch_arena = None

    def settle(self) -> None:
        """Before a Run reads what our kernels and uploads wrote. On the shared stream nothing to
        wait for (the Run comes after them on the stream); on the legacy stream 0, wait for it
        (ONNX Runtime's own stream does not wait for stream 0)."""
        if not self.shared_stream:
            self.synchronize()

    def synchronize(self) -> None:
        """Waits for everything enqueued on our stream: before memory we wrote is read by anything
        that is not ordered by that stream (a new session reading weights, the host)."""
        self.native.synchronize(self.stream, self.device_index)
