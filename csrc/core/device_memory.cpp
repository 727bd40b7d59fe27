#include "core/device_memory.h"

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#ifdef ORTSPEC_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace ortspec {
#ifndef ORTSPEC_WITH_CUDA
namespace {

[[noreturn]] void throw_cuda_not_compiled() {
  throw std::runtime_error(
      "ortspec._native was built without CUDA, so device='cuda' is unavailable. Rebuild with "
      "nvcc reachable (CUDA_HOME, /usr/local/cuda or PATH) and ORTSPEC_NO_CUDA unset: "
      "pip install --no-build-isolation -e .");
}

}  // namespace
#endif

std::size_t align_up(std::size_t nbytes) {
  return (nbytes + kAlignmentBytes - 1) / kAlignmentBytes * kAlignmentBytes;
}

bool cuda_compiled() {
#ifdef ORTSPEC_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int cuda_device_count() {
#ifdef ORTSPEC_WITH_CUDA
  return cuda::device_count();
#else
  return 0;
#endif
}

void require_device(Device device) {
  if (!device.is_cuda()) return;
#ifdef ORTSPEC_WITH_CUDA
  cuda::DeviceGuard check_only(device.index);  // throws with the reason when unusable
#else
  throw_cuda_not_compiled();
#endif
}

DeviceAllocation::DeviceAllocation(std::size_t nbytes, Device device)
    : nbytes_(nbytes), device_(device) {
  std::size_t reserved = align_up(nbytes == 0 ? 1 : nbytes);  // distinct, aligned, non-null
  if (device.is_cuda()) {
#ifdef ORTSPEC_WITH_CUDA
    data_ = cuda::allocate(reserved, device.index);
#else
    throw_cuda_not_compiled();
#endif
  } else {
    data_ = std::aligned_alloc(kAlignmentBytes, reserved);
    if (data_ == nullptr) {
      throw std::runtime_error("host allocation of " + std::to_string(reserved) +
                               " bytes failed");
    }
    std::memset(data_, 0, reserved);
  }
}

DeviceAllocation::~DeviceAllocation() {
  if (device_.is_cuda()) {
#ifdef ORTSPEC_WITH_CUDA
    cuda::release(data_, device_.index);
#endif
  } else {
    std::free(data_);
  }
}

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device,
                std::size_t nbytes, std::uintptr_t stream) {
  if (nbytes == 0) return;
  if (!dst_device.is_cuda() && !src_device.is_cuda()) {
    std::memmove(dst, src, nbytes);
    return;
  }
#ifdef ORTSPEC_WITH_CUDA
  if (dst_device.is_cuda() && src_device.is_cuda()) {
    if (dst_device != src_device) {
      cuda::copy_peer_async(dst, dst_device.index, src, src_device.index, nbytes, stream);
    } else {
      cuda::copy_async(dst, src, nbytes, cuda::CopyKind::kDeviceToDevice, dst_device.index, stream);
    }
  } else if (dst_device.is_cuda()) {
    cuda::copy_async(dst, src, nbytes, cuda::CopyKind::kHostToDevice, dst_device.index, stream);
  } else {
    cuda::copy_async(dst, src, nbytes, cuda::CopyKind::kDeviceToHost, src_device.index, stream);
  }
#else
  (void)stream;
  throw_cuda_not_compiled();
#endif
}

void fill_zero(void* dst, Device device, std::size_t nbytes, std::uintptr_t stream) {
  if (nbytes == 0) return;
  if (!device.is_cuda()) {
    std::memset(dst, 0, nbytes);
    return;
  }
#ifdef ORTSPEC_WITH_CUDA
  cuda::fill_zero_async(dst, nbytes, device.index, stream);
#else
  (void)stream;
  throw_cuda_not_compiled();
#endif
}

void synchronize(Device device, std::uintptr_t stream) {
  if (!device.is_cuda()) return;
#ifdef ORTSPEC_WITH_CUDA
  cuda::synchronize(device.index, stream);
#else
  (void)stream;
  throw_cuda_not_compiled();
#endif
}

}  // namespace ortspec
