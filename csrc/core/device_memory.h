// Raw memory on the CPU or a CUDA device: allocate once, copy, zero.
//
// The one place that decides between host memory and cudaMalloc, so that the
// arena and the persistent buffers are written once for both devices. In a
// CPU-only build every CUDA request fails with a message saying how to get a
// CUDA build.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/tensor_ref.h"

namespace ortspec {

// Every block ortspec hands out starts on this boundary: what cudaMalloc
// guarantees, and enough for any vectorized load in ONNX Runtime's kernels.
constexpr std::size_t kAlignmentBytes = 256;

// Rounds nbytes up to a multiple of kAlignmentBytes.
std::size_t align_up(std::size_t nbytes);

// One zero-filled allocation, freed when the object dies. Not copyable: share it
// through a std::shared_ptr so that views can keep it alive.
class DeviceAllocation {
 public:
  DeviceAllocation(std::size_t nbytes, Device device);
  ~DeviceAllocation();
  DeviceAllocation(const DeviceAllocation&) = delete;
  DeviceAllocation& operator=(const DeviceAllocation&) = delete;

  void* data() const { return data_; }
  std::size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }

 private:
  void* data_ = nullptr;
  std::size_t nbytes_ = 0;
  Device device_;
};

// Copies nbytes between any two of {cpu, cuda:N} (a peer copy between two CUDA
// devices). Asynchronous on `stream` when a device is involved (the destination's
// stream for a peer copy).
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device,
                std::size_t nbytes, std::uintptr_t stream);

// Zeroes nbytes; asynchronous on `stream` for CUDA memory.
void fill_zero(void* dst, Device device, std::size_t nbytes, std::uintptr_t stream);

// Waits for `stream` on a CUDA device; nothing to do for the CPU.
void synchronize(Device device, std::uintptr_t stream);

// Whether this build compiled the CUDA sources.
bool cuda_compiled();

// Usable CUDA devices; 0 in a CPU-only build or without GPU/driver.
int cuda_device_count();

// Throws std::runtime_error unless `device` can be used by this build and machine.
void require_device(Device device);

}  // namespace ortspec
