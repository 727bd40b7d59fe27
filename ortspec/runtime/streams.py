"""The CUDA stream that ortspec and ONNX Runtime share, and device results read a step late.

``device_stream``: one non-blocking stream per device for the whole process. Every CUDA
session runs on it (provider option ``user_compute_stream``) and ``CudaArrays`` enqueues every
native kernel, upload and download on it, so the stream itself orders ONNX Runtime's work and
ours: the host need not wait between them, only where it reads a result. It lives as long as the
process: an ONNX Runtime session must never outlive its user stream, and a session may outlive
any one Session that made it (a stale holder). One stream per device costs no overlap, because
``graphs.CUDA_LOCK`` already serialises all CUDA work of the process.

``SHARED_STREAM`` (environment ``ORTSPEC_CUDA_STREAM``: ``shared``, the default, or ``legacy``)
switches back to the former arrangement, for A/B measurements and as the way out should an
ONNX Runtime build refuse a user stream: ONNX Runtime on its own stream, our kernels on the
legacy stream 0, a synchronisation before every Run, and no pipelined greedy loop.

``Readback`` (CUDA) / ``HostReadback`` (CPU): a small result copied to the host without
waiting. ``start(buffer)`` enqueues a copy into page-locked memory behind an event and returns
at once; ``wait()`` blocks until that copy has landed. A loop that starts step n's copy, then
enqueues step n+1, then waits for step n reads every result a step late while the GPU works;
``StepReadbacks`` holds the two such copies that loop needs (steps n and n+1 in flight).
"""

from __future__ import annotations

import os
import threading

import numpy as np

SHARED_STREAM = os.environ.get("ORTSPEC_CUDA_STREAM", "shared") != "legacy"

_streams: dict[int, object] = {}
_streams_lock = threading.Lock()


def device_stream(native, device_index: int):
    """The process's stream on this device (an ``ortspec._native.Stream``), made on first use."""
    with _streams_lock:
        stream = _streams.get(device_index)
        if stream is None:
            stream = _streams[device_index] = native.Stream(device_index)
        return stream


class Readback:
    """One device buffer's bytes on the host, copied behind an event (CUDA)."""

    def __init__(self, native, stream_handle: int, device_index: int, shape, dtype: str) -> None:
        self.native, self.stream_handle = native, stream_handle
        self.host = native.pinned_host_buffer(tuple(int(s) for s in shape), dtype)  # page-locked
        self.event = native.Event(device_index)
        self._source = None

    def start(self, buffer) -> None:
        """Enqueues host <- buffer on the stream; returns at once. The buffer is kept alive until
        wait(): its memory may belong to ONNX Runtime (an eager run's output)."""
        self.native.copy_to_host(self.host, buffer, stream=self.stream_handle)
        self.event.record(self.stream_handle)
        self._source = buffer

    def wait(self) -> np.ndarray:
        """The bytes of the last start(), once they are on the host (a copy)."""
        self.event.synchronize()
        self._source = None
        return np.array(self.host.numpy())


class HostReadback:
    """The CPU twin of Readback: the buffer is already on the host, so start() copies it."""

    def __init__(self) -> None:
        self._value = None

    def start(self, array) -> None:
        self._value = np.array(array)

    def wait(self) -> np.ndarray:
        return self._value


class StepReadbacks:
    """A per-step result read a step late: step n copies into readback n % 2, so step n+1's copy
    can start before step n's is read (two in flight, never more in a loop one step ahead)."""

    def __init__(self, arrays, shape, dtype) -> None:
        self._readbacks = [arrays.readback(shape, dtype) for _ in range(2)]

    def start(self, n: int, buffer) -> None:
        self._readbacks[n % 2].start(buffer)

    def wait(self, n: int) -> np.ndarray:
        """Step n's result on the host (waits for that copy only)."""
        return self._readbacks[n % 2].wait()

    def close(self) -> None:
        """Drops the page-locked memory and events (a caller holds the device lock: ``DecodeRun.close``)."""
        self._readbacks = []
