#include "core/streams.h"

#include <memory>
#include <stdexcept>
#include <string>

#include "core/device_memory.h"
#include "core/errors.h"

#ifdef ORTSPEC_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace ortspec {
namespace {

#ifndef ORTSPEC_WITH_CUDA
[[noreturn]] void no_cuda(const char* what) {
  throw std::runtime_error(std::string(what) +
                           " needs CUDA, but ortspec._native was built without it. Rebuild with "
                           "nvcc reachable and ORTSPEC_NO_CUDA unset: pip install --no-build-isolation -e .");
}
#endif

}  // namespace

Stream::Stream(int device) : device_(device) {
#ifdef ORTSPEC_WITH_CUDA
  handle_ = cuda::create_stream(device);
#else
  no_cuda("a CUDA stream");
#endif
}

Stream::~Stream() {
#ifdef ORTSPEC_WITH_CUDA
  cuda::destroy_stream(handle_, device_);
#endif
}

void Stream::synchronize() const { ortspec::synchronize(Device::cuda(device_), handle_); }

bool Stream::idle() const {
#ifdef ORTSPEC_WITH_CUDA
  return cuda::stream_idle(handle_, device_);
#else
  return true;
#endif
}

Event::Event(int device) : device_(device) {
#ifdef ORTSPEC_WITH_CUDA
  handle_ = cuda::create_event(device);
#else
  no_cuda("a CUDA event");
#endif
}

Event::~Event() {
#ifdef ORTSPEC_WITH_CUDA
  cuda::destroy_event(handle_, device_);
#endif
}

void Event::record(std::uintptr_t stream) {
#ifdef ORTSPEC_WITH_CUDA
  cuda::record_event(handle_, stream, device_);
#else
  (void)stream;
#endif
}

bool Event::done() const {
#ifdef ORTSPEC_WITH_CUDA
  return cuda::event_done(handle_, device_);
#else
  return true;
#endif
}

void Event::synchronize() const {
#ifdef ORTSPEC_WITH_CUDA
  cuda::synchronize_event(handle_, device_);
#endif
}

Buffer pinned_host_buffer(const Shape& shape, DType dtype) {
  TensorRef ref{nullptr, dtype, shape, Device::cpu()};
  std::size_t nbytes = align_up(ref.nbytes() == 0 ? 1 : ref.nbytes());
#ifdef ORTSPEC_WITH_CUDA
  void* pointer = cuda::allocate_pinned(nbytes);
  ref.data = pointer;
  return Buffer::owning(std::move(ref), std::shared_ptr<const void>(pointer, [](const void* p) {
                          cuda::release_pinned(const_cast<void*>(p));
                        }));
#else
  (void)nbytes;
  no_cuda("page-locked host memory");
#endif
}

void copy_to_host_async(const TensorRef& dst, const TensorRef& src, std::uintptr_t stream) {
  const char* op = "copy_to_host";
  if (dst.device.is_cuda() || !src.device.is_cuda()) {
    throw std::invalid_argument(std::string(op) + ": copies a CUDA src into a CPU dst; got dst on " +
                                dst.device.to_string() + ", src on " + src.device.to_string() +
                                " (device to device: copy_buffer)");
  }
  if (dst.dtype != src.dtype) {
    throw DTypeError(std::string(op) + ": dst is " + dtype_name(dst.dtype) + ", src is " +
                     dtype_name(src.dtype) + "; both must have one dtype");
  }
  if (dst.shape != src.shape) {
    throw std::invalid_argument(std::string(op) + ": dst shape " + shape_to_string(dst.shape) +
                                " differs from src shape " + shape_to_string(src.shape));
  }
  copy_bytes(dst.data, dst.device, src.data, src.device, src.nbytes(), stream);
}

}  // namespace ortspec
