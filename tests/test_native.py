"""Tests of ortspec._native: Python bindings on CPU numpy arrays against numpy references,
error messages for bad input, device kernels against the CPU (GPU hosts only), and the
native ctest binary (csrc/CMakeLists.txt) built and run from scratch.

Shapes: B requests, k drafts, W state-window slots.
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


def reference_accept_lengths(drafts, targets):
    """a[b] = longest prefix where drafts[b, i] == targets[b, i]."""
    matches = drafts == targets[:, :-1]  # [B, k]
    return np.cumprod(matches, axis=1).sum(axis=1).astype(np.int64)  # [B]


def reference_gather(drafts, targets, accepted):
    batch, num_drafts = drafts.shape
    out = np.full((batch, num_drafts + 1), -1, dtype=np.int64)
    for b, a in enumerate(accepted):
        out[b, :a] = drafts[b, :a]
        out[b, a] = targets[b, a]
    return out


def random_step(rng, batch, num_drafts):
    """targets [B, k+1]; drafts [B, k] agreeing on a random prefix, then differing."""
    targets = rng.integers(0, 1000, size=(batch, num_drafts + 1), dtype=np.int64)
    drafts = targets[:, :num_drafts].copy()
    agree = rng.integers(0, num_drafts + 1, size=batch)
    for b in range(batch):
        drafts[b, agree[b]:] += 1 + rng.integers(0, 5, size=num_drafts - agree[b])
    return drafts, targets, agree


# ---- state kernels on CPU ----------------------------------------------------------------


@pytest.mark.parametrize("batch,num_drafts", [(1, 0), (1, 3), (4, 1), (7, 5)])
def test_accept_and_gather_match_numpy(batch, num_drafts):
    rng = np.random.default_rng(batch * 10 + num_drafts)
    drafts, targets, agree = random_step(rng, batch, num_drafts)
    accepted = native.accept_lengths(drafts, targets)
    np.testing.assert_array_equal(accepted, reference_accept_lengths(drafts, targets))
    np.testing.assert_array_equal(accepted, agree)
    emitted = native.gather_accepted_tokens(drafts, targets, accepted)
    np.testing.assert_array_equal(emitted, reference_gather(drafts, targets, accepted))

    out = np.empty(batch, dtype=np.int64)
    assert native.accept_lengths(drafts, targets, out=out) is out


def test_later_agreement_after_a_mismatch_does_not_count():
    drafts = np.array([[5, 9, 7]], dtype=np.int64)
    targets = np.array([[5, 6, 7, 8]], dtype=np.int64)
    assert native.accept_lengths(drafts, targets).tolist() == [1]
    assert native.gather_accepted_tokens(drafts, targets, np.array([1])).tolist() == [[5, 6, -1, -1]]


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


@pytest.mark.parametrize("positions_dtype", [np.int64, np.int32])
@pytest.mark.parametrize("seq_lens_dtype", [np.int64, np.int32])
def test_advance_positions(positions_dtype, seq_lens_dtype):
    positions = np.array([10, 0, 5], dtype=positions_dtype)
    seq_lens = np.array([11, 1, 6], dtype=seq_lens_dtype)
    native.advance_positions(positions, seq_lens, np.array([3, 0, 1], dtype=np.int64))
    assert positions.tolist() == [14, 1, 7] and seq_lens.tolist() == [15, 2, 8]


# ---- error messages ----------------------------------------------------------------------


def test_wrong_dtype_is_a_type_error_naming_the_argument():
    with pytest.raises(TypeError, match="accept_lengths: drafts must be int64, got int32"):
        native.accept_lengths(np.zeros((2, 3), np.int32), np.zeros((2, 4), np.int64))
    with pytest.raises(TypeError, match="targets has numpy dtype float64"):
        native.accept_lengths(np.zeros((2, 3), np.int64), np.zeros((2, 4)))
    with pytest.raises(TypeError, match="must be a numpy.ndarray .* got list"):
        native.accept_lengths([[1, 2]], np.zeros((1, 3), np.int64))
    with pytest.raises(TypeError, match="live must have the window's dtype float32, got float16"):
        native.select_slots(np.zeros((2, 1, 4), np.float32), np.zeros(1, np.int64),
                            np.zeros((1, 4), np.float16))


def test_bad_layout_and_shape_are_value_errors():
    with pytest.raises(ValueError, match=r"targets must be \[B, k\+1\] = \[2, 4\], got \[2, 3\]"):
        native.accept_lengths(np.zeros((2, 3), np.int64), np.zeros((2, 3), np.int64))
    with pytest.raises(ValueError, match="must be C-contiguous"):
        native.accept_lengths(np.zeros((3, 2), np.int64).T, np.zeros((2, 4), np.int64))
    read_only = np.zeros(2, np.int64)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="out is an output but the numpy array is read-only"):
        native.accept_lengths(np.zeros((2, 3), np.int64), np.zeros((2, 4), np.int64), out=read_only)
    with pytest.raises(ValueError, match=r"dst must be src.shape = \[2, 3\], got \[3, 2\]"):
        native.copy_buffer(np.zeros((3, 2), np.float32), np.zeros((2, 3), np.float32))


def test_out_of_range_indices_name_the_row_and_write_nothing():
    live = np.full((2, 4), 7.0, np.float32)
    with pytest.raises(ValueError, match=r"index\[1\]=3 is out of range for a window of W=3"):
        native.select_slots(np.zeros((3, 2, 4), np.float32), np.array([0, 3]), live)
    assert (live == 7.0).all()
    with pytest.raises(ValueError, match=r"accepted\[0\]=4 is out of range 0..k=3"):
        native.gather_accepted_tokens(np.zeros((1, 3), np.int64), np.zeros((1, 4), np.int64),
                                      np.array([4]))
    positions = np.zeros(2, np.int64)
    with pytest.raises(ValueError, match=r"accepted\[1\]=-2 is negative"):
        native.advance_positions(positions, np.zeros(2, np.int64), np.array([0, -2]))
    assert positions.tolist() == [0, 0]


def test_mixed_devices_are_refused():
    host = np.zeros((1, 4), np.int64)
    on_device = native.Buffer.from_pointer(host.ctypes.data, (1, 4), "int64", "cuda")
    with pytest.raises(ValueError, match="drafts is on cpu, targets on cuda:0"):
        native.accept_lengths(np.zeros((1, 3), np.int64), on_device)


@pytest.mark.skipif(native.cuda_available(), reason="checks the message where CUDA is unusable")
def test_cuda_request_without_a_device_says_why():
    expected = "no CUDA device" if native.build_info()["cuda"] else "built without CUDA"
    with pytest.raises(RuntimeError, match=expected):
        native.StepScopedArena(1024, device="cuda")
    assert native.device_count() == 0


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
    drafts = buffers.allocate("drafts", (2, 2), "int64")
    targets = buffers.allocate("targets", (2, 3), "int64")
    accepted = buffers.allocate("accepted", (2,), "int64")
    drafts.copy_from_numpy(np.array([[1, 2], [3, 4]]))
    targets.copy_from_numpy(np.array([[1, 2, 9], [0, 4, 5]]))
    assert native.accept_lengths(drafts, targets, out=accepted) is accepted
    assert accepted.to_numpy().tolist() == [2, 0]


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
class SlotKey:  # the runtime layer's own key type; the registry reads its attributes
    slot: str
    tokens_per_row: int
    batch_bucket: int


def test_graph_slot_registry_counts_and_ids():
    registry = native.GraphSlotRegistry()
    verify, decode = SlotKey("verify", 4, 2), native.GraphSlotKey("decode", 1, 2)
    assert registry.graph_id(verify) == 1 and registry.graph_id(decode) == 2
    assert registry.graph_id(("verify", 4, 2)) == 1
    registry.on_fallback(verify)
    registry.on_capture(verify)
    registry.on_replay(verify)
    registry.on_replay(verify)
    registry.invalidate(verify)
    assert not registry.is_captured(verify)
    assert registry.counters()[("verify", 4, 2)] == {
        "graph_id": 1, "captures": 1, "replays": 2, "fallbacks": 1, "invalidations": 1,
        "captured": False,
    }
    with pytest.raises(RuntimeError, match=r"verify\(M=4, B=2\) \(graph id 1\) replayed while no graph"):
        registry.on_replay(verify)
    registry.on_capture(decode)
    with pytest.raises(RuntimeError, match="already captured"):
        registry.on_capture(decode)
    released = registry.release_all()
    assert set(released) == {("verify", 4, 2), ("decode", 1, 2)} and len(registry) == 0
    assert registry.graph_id(decode) == 3  # ids are never reused
    with pytest.raises(ValueError, match="must be >= 1"):
        native.GraphSlotKey("decode", 0, 1)
    with pytest.raises(TypeError, match="graph slot key must be"):
        registry.graph_id("decode")


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
    batch, num_drafts, slots = 6, 4, 5
    drafts, targets, _ = random_step(rng, batch, num_drafts)
    window = rng.standard_normal((slots, batch, 3, 16)).astype(np.float32)
    index = rng.integers(0, slots, size=batch, dtype=np.int64)
    device = native.PersistentBuffers(device="cuda")

    def upload(name, array):
        buffer = device.allocate(name, array.shape, array.dtype)
        buffer.copy_from_numpy(array)
        return buffer

    drafts_gpu, targets_gpu = upload("drafts", drafts), upload("targets", targets)
    accepted = device.allocate("accepted", (batch,), "int64")
    emitted = device.allocate("emitted", (batch, num_drafts + 1), "int64")
    native.accept_lengths(drafts_gpu, targets_gpu, out=accepted)
    native.gather_accepted_tokens(drafts_gpu, targets_gpu, accepted, out=emitted)
    live = device.allocate("live", (batch, 3, 16), "float32")
    native.select_slots(upload("window", window), upload("index", index), live)
    snapshot = device.allocate("snapshot", (batch, 3, 16), "float32")
    native.copy_buffer(snapshot, live)
    positions, seq_lens = upload("positions", np.arange(batch)), upload("seq_lens", np.arange(batch, dtype=np.int32))
    native.advance_positions(positions, seq_lens, accepted)
    native.check_device_errors()

    cpu_accepted = native.accept_lengths(drafts, targets)
    np.testing.assert_array_equal(accepted.to_numpy(), cpu_accepted)
    np.testing.assert_array_equal(emitted.to_numpy(), native.gather_accepted_tokens(drafts, targets, cpu_accepted))
    np.testing.assert_array_equal(snapshot.to_numpy(), window[index, np.arange(batch)])
    np.testing.assert_array_equal(positions.to_numpy(), np.arange(batch) + cpu_accepted + 1)
    np.testing.assert_array_equal(seq_lens.to_numpy(), np.arange(batch) + cpu_accepted + 1)

    native.select_slots(device["window"], upload("bad_index", np.array([0, 1, 2, 3, 9, 0])), live)
    with pytest.raises(ValueError, match=r"index\[4\]=9 is out of range for a window of W=5"):
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
    positions = device.allocate("positions", (3,), "int64")
    seq_lens = device.allocate("seq_lens", (3,), "int32")
    accepted = device.allocate("accepted", (3,), "int64")
    accepted.copy_from_numpy(np.array([0, 2, 4]))
    stream = torch.cuda.Stream()
    native.advance_positions(positions, seq_lens, accepted, stream=stream.cuda_stream)
    native.synchronize(stream.cuda_stream)
    assert positions.to_numpy().tolist() == [1, 3, 5]

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        native.advance_positions(positions, seq_lens, accepted,
                                 stream=torch.cuda.current_stream().cuda_stream)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    # One eager call, plus three replays (capture itself does not run the kernel).
    assert positions.to_numpy().tolist() == [4, 12, 20]
    assert seq_lens.to_numpy().tolist() == [4, 12, 20]
    native.check_device_errors()


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
