// Streams, events and page-locked host memory: what lets the host run ahead of the GPU.
//
// ONNX Runtime's CUDA sessions can run on a stream the caller owns (provider option
// user_compute_stream). When the state kernels, uploads and downloads are enqueued on that
// same stream, the stream itself orders every piece of a step, so the host never has to wait
// between ONNX Runtime's work and ours. It waits only where it reads a result: the result is
// copied into page-locked host memory (copy_to_host_async, which returns at once) and an Event
// recorded behind the copy says when the bytes are there.
//
//   Stream               a non-blocking stream (never waits for the legacy stream 0)
//   Event                record(stream) after some work; done() / synchronize() ask about it
//   pinned_host_buffer   a CPU Buffer in page-locked memory (cudaMallocHost)
//   copy_to_host_async   host <- device, same dtype and shape, enqueued on a stream
//
// In a build without CUDA, or without a device, every constructor throws
// std::runtime_error saying why.
#pragma once

#include <cstdint>

#include "core/arena.h"
#include "core/tensor_ref.h"

namespace ortspec {

class Stream {
 public:
  explicit Stream(int device);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  // The cudaStream_t as an integer: what ONNX Runtime's user_compute_stream and every
  // native function's `stream` argument take.
  std::uintptr_t handle() const { return handle_; }
  int device() const { return device_; }
  // Waits for everything enqueued so far.
  void synchronize() const;
  // Whether everything enqueued so far has finished; never blocks.
  bool idle() const;

 private:
  std::uintptr_t handle_ = 0;
  int device_ = 0;
};

class Event {
 public:
  explicit Event(int device);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  // Marks the point after all work enqueued on `stream` so far.
  void record(std::uintptr_t stream);
  // Whether the work before the last record() has finished (true before any record); never blocks.
  bool done() const;
  // Blocks until the work before the last record() has finished.
  void synchronize() const;
  int device() const { return device_; }

 private:
  std::uintptr_t handle_ = 0;
  int device_ = 0;
};

// A zero-filled CPU Buffer of [shape] dtype in page-locked memory, freed with its last view.
Buffer pinned_host_buffer(const Shape& shape, DType dtype);

// dst (CPU) <- src (CUDA), same dtype and shape, enqueued on `stream`; returns before the copy
// is done when dst is page-locked. Throws std::invalid_argument / DTypeError naming the problem.
void copy_to_host_async(const TensorRef& dst, const TensorRef& src, std::uintptr_t stream);

}  // namespace ortspec
