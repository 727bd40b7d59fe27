// The argument checks every kernel entry point makes (state_kernels.cpp, transition_kernels.cpp):
// each throws DTypeError or std::invalid_argument with the function, the argument, what was
// expected and what it got.
#pragma once

#include <cstddef>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "core/device_memory.h"
#include "core/errors.h"
#include "core/tensor_ref.h"

namespace ortspec::checks {

struct NamedTensor {
  const char* name;
  const TensorRef& ref;
};

inline void require_dtype(const char* op, const NamedTensor& tensor, DType dtype) {
  if (tensor.ref.dtype != dtype) {
    throw DTypeError(std::string(op) + ": " + tensor.name + " must be " + dtype_name(dtype) +
                     ", got " + dtype_name(tensor.ref.dtype));
  }
}

inline void require_shape(const char* op, const NamedTensor& tensor, const Shape& expected,
                          const std::string& meaning) {
  if (tensor.ref.shape != expected) {
    throw std::invalid_argument(std::string(op) + ": " + tensor.name + " must be " + meaning +
                                " = " + shape_to_string(expected) + ", got " +
                                shape_to_string(tensor.ref.shape));
  }
}

inline void require_rank(const char* op, const NamedTensor& tensor, std::size_t rank,
                         const char* meaning) {
  if (tensor.ref.ndim() != rank) {
    throw std::invalid_argument(std::string(op) + ": " + tensor.name + " must be " + meaning +
                                " (rank " + std::to_string(rank) + "), got shape " +
                                shape_to_string(tensor.ref.shape));
  }
}

// All tensors on one device, and that device usable; returns it.
inline Device require_one_device(const char* op, std::initializer_list<NamedTensor> tensors) {
  const NamedTensor& first = *tensors.begin();
  for (const NamedTensor& tensor : tensors) {
    if (tensor.ref.device != first.ref.device) {
      throw std::invalid_argument(std::string(op) + ": all tensors must be on one device; " +
                                  first.name + " is on " + first.ref.device.to_string() + ", " +
                                  tensor.name + " on " + tensor.ref.device.to_string());
    }
  }
  require_device(first.ref.device);
  return first.ref.device;
}

#ifndef ORTSPEC_WITH_CUDA
// A CUDA tensor past require_one_device() in a build without CUDA: cannot happen (it throws first).
[[noreturn]] inline void unreachable_cuda() {
  throw std::logic_error("CUDA tensor reached a kernel in a build without CUDA");
}
#endif

}  // namespace ortspec::checks
