// Validation and device dispatch for the state kernels (see state_kernels.h).
//
// Every check happens here, once, for both devices, so the CPU reference and
// the CUDA kernels only ever see tensors of the right dtype, shape and device.
#include "core/state_kernels.h"

#include <algorithm>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "core/device_memory.h"
#include "core/errors.h"

#ifdef ORTSPEC_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace ortspec {
namespace {

struct NamedTensor {
  const char* name;
  const TensorRef& ref;
};

void require_dtype(const char* op, const NamedTensor& tensor, DType dtype) {
  if (tensor.ref.dtype != dtype) {
    throw DTypeError(std::string(op) + ": " + tensor.name + " must be " + dtype_name(dtype) +
                     ", got " + dtype_name(tensor.ref.dtype));
  }
}

void require_index_dtype(const char* op, const NamedTensor& tensor) {
  if (tensor.ref.dtype != DType::kInt32 && tensor.ref.dtype != DType::kInt64) {
    throw DTypeError(std::string(op) + ": " + tensor.name + " must be int32 or int64, got " +
                     dtype_name(tensor.ref.dtype));
  }
}

void require_shape(const char* op, const NamedTensor& tensor, const Shape& expected,
                   const std::string& meaning) {
  if (tensor.ref.shape != expected) {
    throw std::invalid_argument(std::string(op) + ": " + tensor.name + " must be " + meaning +
                                " = " + shape_to_string(expected) + ", got " +
                                shape_to_string(tensor.ref.shape));
  }
}

void require_rank(const char* op, const NamedTensor& tensor, std::size_t rank,
                  const char* meaning) {
  if (tensor.ref.ndim() != rank) {
    throw std::invalid_argument(std::string(op) + ": " + tensor.name + " must be " + meaning +
                                " (rank " + std::to_string(rank) + "), got shape " +
                                shape_to_string(tensor.ref.shape));
  }
}

// All tensors on one device, and that device usable; returns it.
Device require_one_device(const char* op, std::initializer_list<NamedTensor> tensors) {
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
[[noreturn]] void unreachable_cuda() {  // require_one_device() already refused CUDA tensors
  throw std::logic_error("CUDA tensor reached a kernel in a build without CUDA");
}
#endif

}  // namespace

void accept_lengths(const TensorRef& drafts, const TensorRef& targets, const TensorRef& accepted,
                    std::uintptr_t stream) {
  const char* op = "accept_lengths";
  NamedTensor drafts_arg{"drafts", drafts}, targets_arg{"targets", targets},
      accepted_arg{"accepted", accepted};
  for (const NamedTensor& each : {drafts_arg, targets_arg, accepted_arg}) {
    require_dtype(op, each, DType::kInt64);
  }
  require_rank(op, drafts_arg, 2, "[B, k]");
  std::int64_t batch = drafts.shape[0], num_drafts = drafts.shape[1];
  require_shape(op, targets_arg, {batch, num_drafts + 1}, "[B, k+1]");
  require_shape(op, accepted_arg, {batch}, "[B]");
  Device device = require_one_device(op, {drafts_arg, targets_arg, accepted_arg});
  if (!device.is_cuda()) {
    cpu::accept_lengths(drafts.as<std::int64_t>(), targets.as<std::int64_t>(),
                        accepted.as<std::int64_t>(), batch, num_drafts);
    return;
  }
#ifdef ORTSPEC_WITH_CUDA
  cuda::accept_lengths(drafts.as<std::int64_t>(), targets.as<std::int64_t>(),
                       accepted.as<std::int64_t>(), batch, num_drafts, device.index, stream);
#else
  (void)stream;
  unreachable_cuda();
#endif
}

void select_slots(const TensorRef& window, const TensorRef& index, const TensorRef& live,
                  std::uintptr_t stream) {
  const char* op = "select_slots";
  NamedTensor window_arg{"window", window}, index_arg{"index", index}, live_arg{"live", live};
  require_dtype(op, index_arg, DType::kInt64);
  if (live.dtype != window.dtype) {
    throw DTypeError(std::string(op) + ": live must have the window's dtype " +
                     dtype_name(window.dtype) + ", got " + dtype_name(live.dtype));
  }
  if (live.ndim() < 2) {
    throw std::invalid_argument(std::string(op) + ": live must be [B, ...] with at least one "
                                "feature dimension, got shape " + shape_to_string(live.shape));
  }
  std::int64_t batch = live.shape[0];
  if (window.ndim() != live.ndim() + 1 ||
      !std::equal(live.shape.begin(), live.shape.end(), window.shape.begin() + 1)) {
    Shape expected = live.shape;
    expected.insert(expected.begin(), window.ndim() > 0 ? window.shape[0] : 1);
    require_shape(op, window_arg, expected, "[W] + live.shape");
  }
  require_shape(op, index_arg, {batch}, "[B]");
  Device device = require_one_device(op, {window_arg, index_arg, live_arg});
  std::int64_t num_slots = window.shape[0];
  std::size_t row_bytes = batch == 0 ? 0 : live.nbytes() / static_cast<std::size_t>(batch);
  if (!device.is_cuda()) {
    cpu::select_slots(window.data, index.as<std::int64_t>(), live.data, num_slots, batch,
                      row_bytes);
    return;
  }
#ifdef ORTSPEC_WITH_CUDA
  cuda::select_slots(window.data, index.as<std::int64_t>(), live.data, num_slots, batch,
                     row_bytes, device.index, stream);
#else
  (void)stream;
  unreachable_cuda();
#endif
}

void copy_buffer(const TensorRef& dst, const TensorRef& src, std::uintptr_t stream) {
  const char* op = "copy_buffer";
  NamedTensor dst_arg{"dst", dst}, src_arg{"src", src};
  require_dtype(op, dst_arg, src.dtype);
  require_shape(op, dst_arg, src.shape, "src.shape");
  Device device = require_one_device(op, {dst_arg, src_arg});
  copy_bytes(dst.data, device, src.data, device, src.nbytes(), stream);
}

void advance_positions(const TensorRef& positions, const TensorRef& seq_lens,
                       const TensorRef& accepted, std::uintptr_t stream) {
  const char* op = "advance_positions";
  NamedTensor positions_arg{"positions", positions}, seq_lens_arg{"seq_lens", seq_lens},
      accepted_arg{"accepted", accepted};
  require_index_dtype(op, positions_arg);
  require_index_dtype(op, seq_lens_arg);
  require_dtype(op, accepted_arg, DType::kInt64);
  require_rank(op, positions_arg, 1, "[B]");
  std::int64_t batch = positions.shape[0];
  require_shape(op, seq_lens_arg, {batch}, "[B]");
  require_shape(op, accepted_arg, {batch}, "[B]");
  Device device = require_one_device(op, {positions_arg, seq_lens_arg, accepted_arg});
  if (!device.is_cuda()) {
    const std::int64_t* accepted_data = accepted.as<std::int64_t>();
    bool positions_int32 = positions.dtype == DType::kInt32;
    bool seq_lens_int32 = seq_lens.dtype == DType::kInt32;
    if (positions_int32 && seq_lens_int32) {
      cpu::advance_positions(positions.as<std::int32_t>(), seq_lens.as<std::int32_t>(),
                             accepted_data, batch);
    } else if (positions_int32) {
      cpu::advance_positions(positions.as<std::int32_t>(), seq_lens.as<std::int64_t>(),
                             accepted_data, batch);
    } else if (seq_lens_int32) {
      cpu::advance_positions(positions.as<std::int64_t>(), seq_lens.as<std::int32_t>(),
                             accepted_data, batch);
    } else {
      cpu::advance_positions(positions.as<std::int64_t>(), seq_lens.as<std::int64_t>(),
                             accepted_data, batch);
    }
    return;
  }
#ifdef ORTSPEC_WITH_CUDA
  cuda::advance_positions(positions.data, positions.dtype, seq_lens.data, seq_lens.dtype,
                          accepted.as<std::int64_t>(), batch, device.index, stream);
#else
  (void)stream;
  unreachable_cuda();
#endif
}

void gather_accepted_tokens(const TensorRef& drafts, const TensorRef& targets,
                            const TensorRef& accepted, const TensorRef& out,
                            std::uintptr_t stream) {
  const char* op = "gather_accepted_tokens";
  NamedTensor drafts_arg{"drafts", drafts}, targets_arg{"targets", targets},
      accepted_arg{"accepted", accepted}, out_arg{"out", out};
  for (const NamedTensor& each : {drafts_arg, targets_arg, accepted_arg, out_arg}) {
    require_dtype(op, each, DType::kInt64);
  }
  require_rank(op, drafts_arg, 2, "[B, k]");
  std::int64_t batch = drafts.shape[0], num_drafts = drafts.shape[1];
  require_shape(op, targets_arg, {batch, num_drafts + 1}, "[B, k+1]");
  require_shape(op, accepted_arg, {batch}, "[B]");
  require_shape(op, out_arg, {batch, num_drafts + 1}, "[B, k+1]");
  Device device = require_one_device(op, {drafts_arg, targets_arg, accepted_arg, out_arg});
  if (!device.is_cuda()) {
    cpu::gather_accepted_tokens(drafts.as<std::int64_t>(), targets.as<std::int64_t>(),
                                accepted.as<std::int64_t>(), out.as<std::int64_t>(), batch,
                                num_drafts);
    return;
  }
#ifdef ORTSPEC_WITH_CUDA
  cuda::gather_accepted_tokens(drafts.as<std::int64_t>(), targets.as<std::int64_t>(),
                               accepted.as<std::int64_t>(), out.as<std::int64_t>(), batch,
                               num_drafts, device.index, stream);
#else
  (void)stream;
  unreachable_cuda();
#endif
}

std::string take_kernel_error(Device device, std::uintptr_t stream) {
  if (!device.is_cuda()) return "";
#ifdef ORTSPEC_WITH_CUDA
  return cuda::take_kernel_error(device.index, stream);
#else
  (void)stream;
  require_device(device);  // throws "built without CUDA"
  return "";
#endif
}

}  // namespace ortspec
