"""Tests of ortspec._native: Python bindings on CPU numpy arrays against numpy references,
error messages for bad input, device kernels against the CPU (GPU hosts only), and the
native ctest binary (csrc/CMakeLists.txt) built and run from scratch.

Shapes: B requests, W state-window slots, M rows per request.
"""

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ortspec._native_loader import load_native

native = load_native()
REPO_ROOT = Path(__file__).resolve().parents[1]
needs_cuda_device = pytest.mark.skipif(
    not native.cuda_available(),
    reason=f"no usable CUDA device: {native.build_info()['cuda_unavailable_reason']}",
)


# ---- numpy references --------------------------------------------------------------------


def reference_write_rows(cache, rows, positions, counts, axis):
    """cache[b, ..., positions[b, j], ...] = rows[b, ..., j, ...] for j < counts[b] (None: all M)."""
    out = cache.copy()
    for b in range(cache.shape[0]):
        count = positions.shape[1] if counts is None else int(counts[b])
        cache_rows = np.moveaxis(out[b], axis - 1, 0)  # view [L, ...] of out[b]
        new_rows = np.moveaxis(rows[b], axis - 1, 0)  # [M, ...]
        for j in range(count):
            cache_rows[positions[b, j]] = new_rows[j]
    return out


def random_write(rng, cache_shape, axis, num_rows, counts_mode, dtype=np.float32):
    """cache, rows, positions [B, M] (distinct per request; -1 past each count), counts or None."""
    batch, length = cache_shape[0], cache_shape[axis]
    rows_shape = list(cache_shape)
    rows_shape[axis] = num_rows
    cache = rng.standard_normal(cache_shape).astype(dtype)
    rows = rng.standard_normal(rows_shape).astype(dtype)
    positions = np.stack([rng.permutation(length)[:num_rows] for _ in range(batch)]).astype(np.int64)
    positions = positions.reshape(batch, num_rows)
    if counts_mode is None:
        return cache, rows, positions, None
    counts = np.zeros(batch, np.int64) if counts_mode == "zero" else rng.integers(0, num_rows + 1, size=batch)
    for b in range(batch):
        positions[b, counts[b]:] = -1  # never read
    return cache, rows, positions, counts


# ---- state kernels on CPU ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32])
def test_select_slots_matches_numpy(dtype):
    rng = np.random.default_rng(3)
    slots, batch = 4, 3
    window = rng.standard_normal((slots, batch, 2, 3, 5)).astype(dtype)  # [W, B, H, dk, dv]
    index = rng.integers(0, slots, size=batch, dtype=np.int64)
    live = np.zeros((batch, 2, 3, 5), dtype=dtype)
    native.select_slots(window, index, live)
    np.testing.assert_array_equal(live, window[index, np.arange(batch)])


def test_copy_buffer_snapshot_and_restore():
    state = np.random.default_rng(0).standard_normal((2, 4, 8)).astype(np.float32)
    snapshot = np.empty_like(state)
    native.copy_buffer(snapshot, state)
    state += 1.0
    native.copy_buffer(state, snapshot)
    np.testing.assert_array_equal(state, snapshot)


def test_many_states_in_one_call_or_none_on_a_bad_one():
    """copy_buffers / select_slots_many (a step's GDN commit in one call) equal the one-by-one
    calls, and a bad pair anywhere in the list leaves every destination untouched."""
    rng = np.random.default_rng(5)
    srcs = [rng.standard_normal(shape).astype(np.float32) for shape in ((3, 4), (3, 2, 5))]
    dsts = [np.zeros_like(x) for x in srcs]
    native.copy_buffers(dsts, srcs)
    for dst, src in zip(dsts, srcs):
        np.testing.assert_array_equal(dst, src)
    windows = [rng.standard_normal((4,) + x.shape).astype(np.float32) for x in srcs]
    index = np.array([3, 0, 2])
    native.select_slots_many(windows, index, dsts)
    for dst, window in zip(dsts, windows):
        np.testing.assert_array_equal(dst, window[index, np.arange(3)])

    before = [d.copy() for d in dsts]
    with pytest.raises(ValueError, match=r"copy_buffers: pair 1: copy_buffer: dst must be src.shape = \[3, 4\], "
                                         r"got \[3, 2, 5\]"):
        native.copy_buffers(dsts, [srcs[0], srcs[0]])
    on_device = native.Buffer.from_pointer(srcs[1].ctypes.data, srcs[1].shape, "float32", "cuda")
    with pytest.raises(ValueError, match="copy_buffers: pair 1: copy_buffer: all tensors must be on one device"):
        native.copy_buffers(dsts, [srcs[0], on_device])  # every check of copy_buffer runs first, devices too
    with pytest.raises(ValueError, match=r"select_slots_many: state 1: select_slots: window must be \[W\] \+ live.shape"):
        native.select_slots_many([windows[0], windows[0]], index, dsts)
    for dst, kept in zip(dsts, before):
        np.testing.assert_array_equal(dst, kept)


# Our two KV layouts: key [B, kvh, hd, L] (axis 3), value [B, kvh, L, hd] (axis 2); then
# other shapes, the position axis anywhere after the batch.
WRITE_LAYOUTS = [((3, 2, 8, 16), 3, 5), ((3, 2, 16, 8), 2, 5), ((2, 7), 1, 7), ((4, 9, 3), 1, 2),
                 ((2, 3, 2, 6, 5), 3, 4), ((2, 5, 1, 4), 1, 0)]


@pytest.mark.parametrize("cache_shape,axis,num_rows", WRITE_LAYOUTS)
@pytest.mark.parametrize("counts_mode", [None, "partial", "zero"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_write_rows_matches_numpy(cache_shape, axis, num_rows, counts_mode, dtype):
    rng = np.random.default_rng(sum(cache_shape) * 7 + axis)
    cache, rows, positions, counts = random_write(rng, cache_shape, axis, num_rows, counts_mode, dtype)
    expected = reference_write_rows(cache, rows, positions, counts, axis)
    assert native.write_rows(cache, rows, positions, counts, axis=axis) is None
    np.testing.assert_array_equal(cache, expected)

    again = rng.standard_normal(cache_shape).astype(dtype)  # the same axis counted from the back
    expected = reference_write_rows(again, rows, positions, counts, axis)
    native.write_rows(again, rows, positions, counts, axis=axis - len(cache_shape))
    np.testing.assert_array_equal(again, expected)


def test_write_rows_bfloat16_buffers_are_copied_bitwise():
    rng = np.random.default_rng(5)
    buffers = native.PersistentBuffers()
    cache_bits = rng.integers(0, 1 << 16, size=(2, 2, 6, 4), dtype=np.uint16)  # value [B, kvh, L, hd]
    rows_bits = rng.integers(0, 1 << 16, size=(2, 2, 3, 4), dtype=np.uint16)
    positions, counts = np.array([[5, 0, 2], [1, 3, -1]]), np.array([3, 2])
    cache, rows = buffers.allocate("cache", cache_bits.shape, "bfloat16"), buffers.allocate("rows", rows_bits.shape, "bfloat16")
    cache.copy_from_numpy(cache_bits)
    rows.copy_from_numpy(rows_bits)
    native.write_rows(cache, rows, positions, counts, axis=2)
    np.testing.assert_array_equal(cache.to_numpy(), reference_write_rows(cache_bits, rows_bits, positions, counts, 2))


def test_write_rows_duplicate_positions_keep_the_last_on_cpu():
    cache = np.zeros((1, 4), np.float32)
    native.write_rows(cache, np.array([[1.0, 2.0, 3.0]], np.float32), np.array([[1, 1, 3]]), axis=1)
    assert cache.tolist() == [[0.0, 2.0, 0.0, 3.0]]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.int32])
@pytest.mark.parametrize("feature_shape", [(), (16,), (2, 3, 5)])
def test_gather_rows_matches_numpy(dtype, feature_shape):
    rng = np.random.default_rng(len(feature_shape))
    batch, num_rows = 4, 3
    src = (rng.standard_normal((batch, num_rows, *feature_shape)) * 100).astype(dtype)  # [B, M, ...]
    index = rng.integers(0, num_rows, size=batch, dtype=np.int64)
    dst = np.zeros((batch, *feature_shape), dtype)
    assert native.gather_rows(src, index, dst) is None
    np.testing.assert_array_equal(dst, src[np.arange(batch), index])


# ---- error messages ----------------------------------------------------------------------


def test_wrong_dtype_is_a_type_error_naming_the_argument():
    window, live = np.zeros((2, 1, 4), np.float32), np.zeros((1, 4), np.float32)
    with pytest.raises(TypeError, match="select_slots: index must be int64, got int32"):
        native.select_slots(window, np.zeros(1, np.int32), live)
    with pytest.raises(TypeError, match="window has numpy dtype float64"):
        native.select_slots(np.zeros((2, 1, 4)), np.zeros(1, np.int64), live)
    with pytest.raises(TypeError, match="must be a numpy.ndarray .* got list"):
        native.select_slots(window, [0], live)
    with pytest.raises(TypeError, match="live must have the window's dtype float32, got float16"):
        native.select_slots(np.zeros((2, 1, 4), np.float32), np.zeros(1, np.int64),
                            np.zeros((1, 4), np.float16))


def test_bad_layout_and_shape_are_value_errors():
    window, index = np.zeros((3, 2, 4), np.float32), np.zeros(2, np.int64)
    with pytest.raises(ValueError, match=r"select_slots: index must be \[B\] = \[2\], got \[3\]"):
        native.select_slots(window, np.zeros(3, np.int64), np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="must be C-contiguous"):
        native.select_slots(window, index, np.zeros((4, 2), np.float32).T)
    read_only = np.zeros((2, 4), np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="live is an output but the numpy array is read-only"):
        native.select_slots(window, index, read_only)
    with pytest.raises(ValueError, match=r"dst must be src.shape = \[2, 3\], got \[3, 2\]"):
        native.copy_buffer(np.zeros((3, 2), np.float32), np.zeros((2, 3), np.float32))


def test_out_of_range_indices_name_the_row_and_write_nothing():
    live = np.full((2, 4), 7.0, np.float32)
    with pytest.raises(ValueError, match=r"index\[1\]=3 is out of range for a window of W=3"):
        native.select_slots(np.zeros((3, 2, 4), np.float32), np.array([0, 3]), live)
    assert (live == 7.0).all()


def test_write_rows_errors_name_the_argument():
    cache, rows = np.zeros((2, 3, 4), np.float32), np.ones((2, 3, 2), np.float32)  # axis 2: L=4, M=2
    positions = np.array([[0, 1], [2, 3]])
    with pytest.raises(TypeError, match="write_rows: cache must be float32, float16 or bfloat16, got int64"):
        native.write_rows(np.zeros((2, 3, 4), np.int64), rows, positions, axis=2)
    with pytest.raises(TypeError, match="write_rows: rows must have the cache's dtype float32, got float16"):
        native.write_rows(cache, rows.astype(np.float16), positions, axis=2)
    with pytest.raises(TypeError, match="write_rows: positions must be int64, got int32"):
        native.write_rows(cache, rows, positions.astype(np.int32), axis=2)
    with pytest.raises(TypeError, match="write_rows: counts must be int64, got int32"):
        native.write_rows(cache, rows, positions, np.array([1, 1], np.int32), axis=2)
    with pytest.raises(TypeError, match="write_rows: counts must be a numpy.ndarray .* got list"):
        native.write_rows(cache, rows, positions, [1, 1], axis=2)
    with pytest.raises(TypeError):  # axis is keyword-only and has no default
        native.write_rows(cache, rows, positions, None, 2)
    with pytest.raises(TypeError):
        native.write_rows(cache, rows, positions)
    for bad_axis in (0, 3, -3):
        with pytest.raises(ValueError, match=rf"axis={bad_axis} is not a position axis of cache \[2, 3, 4\] "
                                             r"\(rank 3\): use 1..2, or -2..-1 from the end"):
            native.write_rows(cache, rows, positions, axis=bad_axis)
    with pytest.raises(ValueError, match=r"rows must be cache.shape with axis 2 \(the positions\) of "
                                         r"length M=2 = \[2, 3, 2\], got \[2, 2, 3\]"):
        native.write_rows(cache, np.ones((2, 2, 3), np.float32), positions, axis=2)
    with pytest.raises(ValueError, match=r"write_rows: positions must be \[B, M\] = \[2, 2\], got \[3, 2\]"):
        native.write_rows(cache, rows, np.zeros((3, 2), np.int64), axis=2)
    with pytest.raises(ValueError, match=r"write_rows: counts must be \[B\] = \[2\], got \[3\]"):
        native.write_rows(cache, rows, positions, np.zeros(3, np.int64), axis=2)
    read_only = cache.copy()
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="write_rows: cache is an output but the numpy array is read-only"):
        native.write_rows(read_only, rows, positions, axis=2)


def test_write_rows_out_of_range_entries_name_b_j_position_and_length_and_write_nothing():
    cache, rows = np.full((2, 3, 4), 7.0, np.float32), np.ones((2, 3, 2), np.float32)
    with pytest.raises(ValueError, match=r"write_rows: positions\[1, 1\]=4 is out of range for a cache "
                                         r"of L=4 positions \(valid 0..3\)"):
        native.write_rows(cache, rows, np.array([[0, 1], [2, 4]]), axis=2)
    with pytest.raises(ValueError, match=r"positions\[0, 0\]=-1 is out of range for a cache of L=4"):
        native.write_rows(cache, rows, np.array([[-1, 1], [2, 3]]), axis=-1)
    with pytest.raises(ValueError, match=r"write_rows: counts\[1\]=3 is out of range 0..M=2"):
        native.write_rows(cache, rows, np.array([[0, 1], [2, 3]]), np.array([2, 3]), axis=2)
    with pytest.raises(ValueError, match=r"write_rows: counts\[0\]=-1 is out of range 0..M=2"):
        native.write_rows(cache, rows, np.array([[0, 1], [2, 3]]), np.array([-1, 0]), axis=2)
    assert (cache == 7.0).all()
    native.write_rows(cache, rows, np.array([[3, -5], [-5, -5]]), np.array([1, 0]), axis=2)  # past counts: unread
    assert (cache[0, :, 3] == 1.0).all() and (cache[0, :, :3] == 7.0).all() and (cache[1] == 7.0).all()


def test_gather_rows_errors_name_the_argument():
    src, index, dst = np.zeros((2, 4, 3), np.float32), np.array([0, 3]), np.full((2, 3), 5.0, np.float32)
    with pytest.raises(TypeError, match="gather_rows: index must be int64, got int32"):
        native.gather_rows(src, index.astype(np.int32), dst)
    with pytest.raises(TypeError, match="gather_rows: dst must have the src's dtype float32, got float16"):
        native.gather_rows(src, index, dst.astype(np.float16))
    with pytest.raises(ValueError, match=r"gather_rows: src must be \[B, M\] \+ dst.shape\[1:\] = "
                                         r"\[2, 4, 2\], got \[2, 4, 3\]"):
        native.gather_rows(src, index, np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match=r"gather_rows: index must be \[B\] = \[2\], got \[3\]"):
        native.gather_rows(src, np.array([0, 1, 2]), dst)
    with pytest.raises(ValueError, match=r"gather_rows: dst must be \[B, ...\] \(rank >= 1\), got shape \[\]"):
        native.gather_rows(src, index, np.zeros((), np.float32))
    with pytest.raises(ValueError, match=r"gather_rows: index\[1\]=4 is out of range for src of M=4 rows "
                                         r"\(valid 0..3\)"):
        native.gather_rows(src, np.array([1, 4]), dst)
    assert (dst == 5.0).all()


def test_mixed_devices_are_refused():
    host = np.zeros((1, 4), np.float32)
    on_device = native.Buffer.from_pointer(host.ctypes.data, (1, 4), "float32", "cuda")
    with pytest.raises(ValueError, match="window is on cpu, live on cuda:0"):
        native.select_slots(np.zeros((2, 1, 4), np.float32), np.zeros(1, np.int64), on_device)


@pytest.mark.skipif(native.cuda_available(), reason="checks the message where CUDA is unusable")
def test_cuda_request_without_a_device_says_why():
    expected = "no CUDA device" if native.build_info()["cuda"] else "built without CUDA"
    with pytest.raises(RuntimeError, match=expected):
        native.StepScopedArena(1024, device="cuda")
    for make in (native.Stream, native.Event, lambda: native.pinned_host_buffer((2,), "int64")):
        with pytest.raises(RuntimeError, match="CUDA"):
            make()
    assert native.device_count() == 0


def test_advance_decode_inputs_makes_the_next_steps_inputs():
    tokens = np.array([[7], [9], [4]], np.int64)
    ids, positions = np.zeros((3, 1), np.int64), np.array([[5], [62], [63]], np.int64)
    native.advance_decode_inputs(tokens, ids, positions, 63)
    assert ids[:, 0].tolist() == [7, 9, 4] and positions[:, 0].tolist() == [6, 63, 63]  # parked at 63
    with pytest.raises(ValueError, match=r"advance_decode_inputs: positions must be \[B, 1\] = \[3, 1\]"):
        native.advance_decode_inputs(tokens, ids, np.zeros((2, 1), np.int64), 63)
    with pytest.raises(TypeError, match="advance_decode_inputs: ids must be int64"):
        native.advance_decode_inputs(tokens, np.zeros((3, 1), np.float32), positions, 63)


def test_copy_to_host_refuses_wrong_directions_and_shapes():
    host = np.zeros((2, 1), np.int64)
    with pytest.raises(ValueError, match="copies a CUDA src into a CPU dst"):
        native.copy_to_host(host, np.ones((2, 1), np.int64))
    on_device = native.Buffer.from_pointer(host.ctypes.data, (2, 1), "int64", "cuda")
    with pytest.raises(ValueError, match=r"dst shape \[2, 2\] differs from src shape \[2, 1\]"):
        native.copy_to_host(np.zeros((2, 2), np.int64), on_device)
    with pytest.raises(TypeError, match="dst is float32, src is int64"):
        native.copy_to_host(np.zeros((2, 1), np.float32), on_device)


# ---- memory: arena, persistent buffers, zero-copy exports --------------------------------


def test_arena_addresses_stable_and_pinned_region_never_reused():
    arena = native.StepScopedArena(1 << 16)
    graph_input = arena.allocate((64,), "float32")
    graph_input.numpy()[:] = 3.0
    pinned = arena.pin()  # a captured graph now holds graph_input's address
    scratch = arena.allocate((16, 4), np.float32)
    for _ in range(3):
        arena.reset()
        again = arena.allocate((16, 4), "float32")
        again.numpy()[:] = -1.0
        assert again.data_ptr == scratch.data_ptr
        assert again.data_ptr >= arena.base_ptr + pinned
    assert all(b.data_ptr % native.ALIGNMENT_BYTES == 0 for b in (graph_input, scratch))
    assert graph_input.is_live and not scratch.is_live
    assert (graph_input.numpy() == 3.0).all()
    with pytest.raises(RuntimeError, match="stale arena block"):
        scratch.numpy()


def test_arena_overflow_names_requested_and_available_bytes():
    arena = native.StepScopedArena(1024)
    arena.allocate((100,), "float32")
    with pytest.raises(native.ArenaOverflowError,
                       match="requested 800 bytes for float32.*available 512 of 1024 bytes"):
        arena.allocate((200,), "float32")
    assert issubclass(native.ArenaOverflowError, RuntimeError)


def test_persistent_buffers_are_named_once_and_zeroed():
    buffers = native.PersistentBuffers()
    state = buffers.allocate("gdn_state.0", (2, 4, 8), "float32")
    buffers.allocate("positions", (2,), "int64")
    assert buffers.names() == ["gdn_state.0", "positions"] and len(buffers) == 2
    assert buffers["gdn_state.0"].data_ptr == state.data_ptr
    assert not state.numpy().any()
    state.numpy()[:] = 1.0
    buffers.zero_all()
    assert not state.numpy().any()
    with pytest.raises(ValueError, match="already holds 'positions'"):
        buffers.allocate("positions", (4,), "int64")
    with pytest.raises(KeyError, match="known: gdn_state.0, positions"):
        buffers.get("kv_cache")


def test_buffers_are_kernel_arguments():
    buffers = native.PersistentBuffers()
    src = buffers.allocate("src", (2, 3), "int64")  # [B, M]
    index = buffers.allocate("index", (2,), "int64")
    dst = buffers.allocate("dst", (2,), "int64")
    src.copy_from_numpy(np.array([[1, 2, 9], [0, 4, 5]]))
    index.copy_from_numpy(np.array([2, 0]))
    native.gather_rows(src, index, dst)
    assert dst.to_numpy().tolist() == [9, 0]


def test_numpy_and_dlpack_views_share_memory_and_keep_the_owner_alive():
    arena = native.StepScopedArena(4096)
    block = arena.allocate((2, 3), "float32")
    view = np.asarray(block)
    view[:] = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert view.ctypes.data == block.data_ptr
    np.testing.assert_array_equal(np.from_dlpack(block), view)

    onnxruntime = pytest.importorskip("onnxruntime")
    if not hasattr(onnxruntime.OrtValue, "from_dlpack"):
        pytest.skip(f"onnxruntime {onnxruntime.__version__} has no OrtValue.from_dlpack")
    value = onnxruntime.OrtValue.from_dlpack(block)
    assert value.data_ptr() == block.data_ptr and value.shape() == [2, 3]
    np.testing.assert_array_equal(value.numpy(), view)

    torch = pytest.importorskip("torch")
    tensor = torch.from_dlpack(block)
    assert tensor.data_ptr() == block.data_ptr
    del arena, block, view, value  # the DLPack export keeps the arena's memory alive
    assert tensor.sum().item() == 15.0
    bf16 = native.PersistentBuffers().allocate("x", (4,), "bfloat16")
    assert torch.from_dlpack(bf16).dtype == torch.bfloat16


# ---- graph slots -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SlotKey:  # a key type of the caller's; the registry reads its attributes
    slot: str
    tokens_per_row: int
    batch_bucket: int
    engine: int = 0


def test_graph_slot_registry_counts_and_ids():
    registry = native.GraphSlotRegistry()
    verify, decode = SlotKey("verify", 4, 2), native.GraphSlotKey("decode", 1, 2)
    assert registry.graph_id(verify) == 1 and registry.graph_id(decode) == 2
    assert registry.graph_id(("verify", 4, 2)) == 1 and registry.graph_id(("verify", 4, 2, 0)) == 1
    registry.on_fallback(verify)
    registry.on_capture(verify)
    registry.on_replay(verify)
    registry.on_replay(verify)
    registry.invalidate(verify)
    assert not registry.is_captured(verify)
    assert registry.counters()[("verify", 4, 2, 0)] == {
        "graph_id": 1, "captures": 1, "replays": 2, "fallbacks": 1, "invalidations": 1,
        "captured": False,
    }
    with pytest.raises(RuntimeError, match=r"verify\(M=4, B=2, engine 0\) \(graph id 1\) replayed while no graph"):
        registry.on_replay(verify)
    registry.on_capture(decode)
    with pytest.raises(RuntimeError, match="already captured"):
        registry.on_capture(decode)
    released = registry.release_all()
    assert set(released) == {("verify", 4, 2, 0), ("decode", 1, 2, 0)} and len(registry) == 0
    assert registry.graph_id(decode) == 3  # ids are never reused
    with pytest.raises(ValueError, match="must be >= 1"):
        native.GraphSlotKey("decode", 0, 1)
    with pytest.raises(ValueError, match="engine must be >= 0"):
        native.GraphSlotKey("decode", 1, 1, engine=-1)
    with pytest.raises(TypeError, match="graph slot key must be"):
        registry.graph_id("decode")


def test_graph_slot_registry_keys_each_engine_apart():
    """Two engines of one shape alternate: each captures its own graph (its own id) and only
    replays after, so neither counts a fallback or an invalidation."""
    registry = native.GraphSlotRegistry()
    first, second = SlotKey("decode", 1, 4, engine=0), SlotKey("decode", 1, 4, engine=1)
    assert registry.graph_id(first) != registry.graph_id(second)
    assert native.GraphSlotKey("decode", 1, 4, 1) != native.GraphSlotKey("decode", 1, 4, 0)
    registry.on_capture(first)
    registry.on_capture(second)
    for _ in range(3):
        registry.on_replay(first)
        registry.on_replay(second)
    counters = registry.counters()
    assert [(c["captures"], c["replays"], c["fallbacks"], c["invalidations"]) for c in counters.values()] == [
        (1, 3, 0, 0), (1, 3, 0, 0)]
    assert set(counters) == {("decode", 1, 4, 0), ("decode", 1, 4, 1)}


def test_build_info_is_consistent():
    info = native.build_info()
    assert info["version"] == "0.1.0" and info["alignment_bytes"] == native.ALIGNMENT_BYTES
    assert native.cuda_available() == (native.device_count() > 0)
    if not info["cuda"]:
        assert not native.cuda_available() and info["cuda_arch"] is None


# ---- CUDA kernels against the CPU reference (GPU hosts only) -----------------------------


@needs_cuda_device
def test_cuda_kernels_match_cpu():
    rng = np.random.default_rng(11)
    batch, slots = 6, 5
    window = rng.standard_normal((slots, batch, 3, 16)).astype(np.float32)
    index = rng.integers(0, slots, size=batch, dtype=np.int64)
    device = native.PersistentBuffers(device="cuda")

    def upload(name, array):
        buffer = device.allocate(name, array.shape, array.dtype)
        buffer.copy_from_numpy(array)
        return buffer

    live = device.allocate("live", (batch, 3, 16), "float32")
    native.select_slots(upload("window", window), upload("index", index), live)
    snapshot = device.allocate("snapshot", (batch, 3, 16), "float32")
    native.copy_buffer(snapshot, live)
    native.check_device_errors()
    np.testing.assert_array_equal(snapshot.to_numpy(), window[index, np.arange(batch)])

    native.select_slots(device["window"], upload("bad_index", np.array([0, 1, 2, 3, 9, 0])), live)
    with pytest.raises(ValueError, match=r"index\[4\]=9 is out of range for a window of W=5"):
        native.check_device_errors()


@needs_cuda_device
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cuda_write_and_gather_rows_match_cpu(dtype):
    rng = np.random.default_rng(17)
    device = native.PersistentBuffers(device="cuda")

    def cast(values):  # float32 values -> dtype; bfloat16 travels as its bits (uint16)
        if dtype == "bfloat16":
            return (values.view(np.uint32) >> 16).astype(np.uint16)
        return values.astype(dtype)

    def upload(name, array, buffer_dtype=None):
        buffer = device.allocate(name, array.shape, buffer_dtype or array.dtype)
        buffer.copy_from_numpy(array)
        return buffer

    for name, (cache_shape, axis, num_rows) in [("key", ((4, 2, 64, 48), 3, 9)),
                                                ("value", ((4, 2, 48, 64), 2, 9))]:
        cache, rows, positions, counts = random_write(rng, cache_shape, axis, num_rows, "partial")
        cache, rows = cast(cache), cast(rows)
        cache_gpu = upload(f"{name}_cache", cache, dtype)
        native.write_rows(cache_gpu, upload(f"{name}_rows", rows, dtype), upload(f"{name}_positions", positions),
                          upload(f"{name}_counts", counts), axis=axis)
        native.check_device_errors()
        np.testing.assert_array_equal(cache_gpu.to_numpy(), reference_write_rows(cache, rows, positions, counts, axis))

    src = cast(rng.standard_normal((4, 9, 96)).astype(np.float32))  # [B, M, hidden]
    index = np.array([8, 0, 3, 8])
    dst = device.allocate("dst", (4, 96), dtype)
    native.gather_rows(upload("src", src, dtype), upload("index", index), dst)
    native.check_device_errors()
    np.testing.assert_array_equal(dst.to_numpy(), src[np.arange(4), index])

    bad_positions = np.tile(np.arange(9), (4, 1))
    bad_positions[2, 5] = 48
    native.write_rows(device["key_cache"], device["key_rows"], upload("bad", bad_positions), axis=3)
    with pytest.raises(ValueError, match=r"write_rows: positions\[2, 5\]=48 is out of range for a cache of "
                                         r"L=48 positions"):
        native.check_device_errors()
    native.gather_rows(device["src"], upload("bad_index", np.array([0, 9, 0, 0])), dst)
    with pytest.raises(ValueError, match=r"gather_rows: index\[1\]=9 is out of range for src of M=9 rows"):
        native.check_device_errors()


@needs_cuda_device
def test_cuda_buffers_wrap_in_onnxruntime_and_torch_without_copies():
    arena = native.StepScopedArena(1 << 20, device="cuda")
    block = arena.allocate((4, 8), "float16")
    block.copy_from_numpy(np.ones((4, 8), np.float16))
    assert block.__dlpack_device__() == (2, 0)
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        tensor = torch.from_dlpack(block)
        assert tensor.is_cuda and tensor.data_ptr() == block.data_ptr
        assert tensor.float().sum().item() == 32.0


@needs_cuda_device
def test_cuda_kernels_run_on_a_callers_stream_and_inside_a_cuda_graph():
    """Kernels go on the caller's stream and can be captured: no sync, no allocation."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    device = native.PersistentBuffers(device="cuda")
    window = device.allocate("window", (3, 2, 4), "float32")  # [W, B, N]
    index = device.allocate("index", (2,), "int64")
    live = device.allocate("live", (2, 4), "float32")
    index.copy_from_numpy(np.array([2, 0]))
    values = np.arange(24, dtype=np.float32).reshape(3, 2, 4)
    window.copy_from_numpy(values)
    stream = torch.cuda.Stream()
    native.select_slots(window, index, live, stream=stream.cuda_stream)
    native.synchronize(stream.cuda_stream)
    np.testing.assert_array_equal(live.to_numpy(), values[[2, 0], [0, 1]])

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        native.select_slots(window, index, live, stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    for replay in range(1, 4):  # new window contents each time: a replay re-runs the kernel
        window.copy_from_numpy(values + 100 * replay)
        native.synchronize()  # the upload is done before the replay reads it
        graph.replay()
        torch.cuda.synchronize()
        np.testing.assert_array_equal(live.to_numpy(), values[[2, 0], [0, 1]] + 100 * replay)
    native.check_device_errors()


@needs_cuda_device
def test_cuda_copy_buffers_equal_one_by_one_copies():
    """copy_buffers puts the aligned pairs in one kernel launch and copies the rest one by one;
    every destination ends bitwise equal to its source."""
    rng = np.random.default_rng(5)
    buffers = native.PersistentBuffers(device="cuda")
    sources = [rng.standard_normal(shape).astype(np.float32) for shape in ((3, 256), (8, 48, 48), (5,), (1, 4))]
    srcs, dsts = [], []
    for i, values in enumerate(sources):
        srcs.append(buffers.allocate(f"s{i}", values.shape, "float32"))
        srcs[-1].copy_from_numpy(values)
        dsts.append(buffers.allocate(f"d{i}", values.shape, "float32"))
    native.copy_buffers(dsts, srcs)
    for dst, values in zip(dsts, sources):
        np.testing.assert_array_equal(dst.to_numpy(), values)


@needs_cuda_device
def test_stream_event_and_pinned_readback_on_the_device():
    """Work on an ortspec Stream; an Event recorded behind a copy into page-locked memory says
    when the bytes are there; a device-to-device copy on the stream feeds the next input."""
    stream, event = native.Stream(), native.Event()
    assert stream.handle != 0 and event.done()  # an event never recorded counts as done
    buffers = native.PersistentBuffers(device="cuda")
    src, fed = buffers.allocate("src", (4, 1), "int64"), buffers.allocate("fed", (4, 1), "int64")
    src.copy_from_numpy(np.arange(4, dtype=np.int64).reshape(4, 1), stream=stream.handle)
    native.copy_buffer(fed, src, stream=stream.handle)
    host = native.pinned_host_buffer((4, 1), "int64")
    native.copy_to_host(host, fed, stream=stream.handle)
    event.record(stream.handle)
    event.synchronize()
    assert event.done() and stream.idle()
    np.testing.assert_array_equal(host.numpy()[:, 0], np.arange(4))


# ---- the native ctest binary ------------------------------------------------------------


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_native_ctest_suites_pass(tmp_path):
    """Configures, builds and runs csrc/CMakeLists.txt's ctest suites in a fresh directory.

    The CUDA suite may only be skipped where this module also has no CUDA device.
    """
    build_dir = tmp_path / "native"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    steps = [
        ["cmake", "-S", str(REPO_ROOT / "csrc"), "-B", str(build_dir), *generator],
        ["cmake", "--build", str(build_dir), "--parallel", str(os.cpu_count() or 2)],
        ["ctest", "--test-dir", str(build_dir), "--output-on-failure"],
    ]
    for command in steps:
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        sys.stdout.write(result.stdout[-4000:])
        assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    summary = result.stdout
    assert "tests passed" in summary and "state_kernels_cpu" in summary
    cuda_skipped = "state_kernels_cuda (Skipped)" in summary
    assert cuda_skipped != native.cuda_available(), summary


# ---- no native code for tests only -------------------------------------------------------

DIAGNOSTICS = {"build_info", "cuda_available", "device_count",
               "last_custom_op_stream"}  # for users and tests, not the step (the last: the GPU check of the custom ops)


def test_every_native_function_is_called_by_the_runtime():
    """A kernel that only tests call is code to maintain, build and trust for nothing: each
    module-level function of ortspec._native (other than the diagnostics) must be called
    from ortspec/ itself, or be removed with its bindings and tests."""
    import types

    source = "\n".join(path.read_text() for path in (REPO_ROOT / "ortspec").rglob("*.py"))
    functions = {name for name, value in vars(native).items()
                 if isinstance(value, types.BuiltinFunctionType) and not name.startswith("_")}
    unused = sorted(name for name in functions - DIAGNOSTICS if f".{name}(" not in source)
    assert not unused, f"native functions no runtime code calls: {unused}"
