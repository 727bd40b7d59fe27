// Validation and device dispatch for the state kernels (see state_kernels.h).
//
// Every check happens here, once, for both devices, so the CPU reference and
// the CUDA kernels only ever see tensors of the right dtype, shape and device.
#include "core/state_kernels.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "core/device_memory.h"
#include "core/errors.h"
#include "core/tensor_checks.h"

#ifdef ORTSPEC_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace ortspec {
namespace {

using namespace checks;  // NamedTensor, require_*, unreachable_cuda

}  // namespace

Device check_select_slots(const TensorRef& window, const TensorRef& index, const TensorRef& live) {
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
  return require_one_device(op, {window_arg, index_arg, live_arg});
}

void select_slots(const TensorRef& window, const TensorRef& index, const TensorRef& live,
                  std::uintptr_t stream) {
  Device device = check_select_slots(window, index, live);
  std::int64_t batch = live.shape[0];
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

void check_copy_buffer(const TensorRef& dst, const TensorRef& src) {
  const char* op = "copy_buffer";
  NamedTensor dst_arg{"dst", dst}, src_arg{"src", src};
  require_dtype(op, dst_arg, src.dtype);
  require_shape(op, dst_arg, src.shape, "src.shape");
  if (dst.device.is_cuda() && src.device.is_cuda()) {  // one GPU, or a peer copy between two
    require_device(dst.device);
    require_device(src.device);
  } else {
    require_one_device(op, {dst_arg, src_arg});
  }
}

void copy_buffer(const TensorRef& dst, const TensorRef& src, std::uintptr_t stream) {
  check_copy_buffer(dst, src);
  copy_bytes(dst.data, dst.device, src.data, src.device, src.nbytes(), stream);
}

#ifdef ORTSPEC_WITH_CUDA
namespace {

bool overlaps(const TensorRef& a, const TensorRef& b) {
  const char* a_begin = static_cast<const char*>(a.data);
  const char* b_begin = static_cast<const char*>(b.data);
  return a_begin < b_begin + b.nbytes() && b_begin < a_begin + a.nbytes();
}

// Whether a pair may go into copy_many: one device, 16-byte words, and no byte shared with
// any other pair (the copies of one launch run in no particular order).
bool batchable(const std::vector<std::pair<TensorRef, TensorRef>>& pairs, std::size_t i) {
  const auto& [dst, src] = pairs[i];
  auto aligned = [](const void* pointer) { return reinterpret_cast<std::uintptr_t>(pointer) % 16 == 0; };
  if (!dst.device.is_cuda() || dst.device != src.device || !aligned(dst.data) || !aligned(src.data) ||
      src.nbytes() % 16 != 0 || overlaps(dst, src)) {
    return false;
  }
  for (std::size_t j = 0; j < pairs.size(); ++j) {
    if (j == i) continue;
    const auto& [other_dst, other_src] = pairs[j];
    if (overlaps(dst, other_dst) || overlaps(dst, other_src) || overlaps(src, other_dst)) return false;
  }
  return true;
}

}  // namespace
#endif

void copy_buffers(const std::vector<std::pair<TensorRef, TensorRef>>& pairs, std::uintptr_t stream) {
  for (const auto& [dst, src] : pairs) check_copy_buffer(dst, src);
#ifdef ORTSPEC_WITH_CUDA
  std::vector<std::vector<cuda::ByteCopy>> by_device;
  std::vector<int> devices;
  for (std::size_t i = 0; i < pairs.size(); ++i) {
    const auto& [dst, src] = pairs[i];
    if (!batchable(pairs, i)) {
      copy_bytes(dst.data, dst.device, src.data, src.device, src.nbytes(), stream);
      continue;
    }
    auto found = std::find(devices.begin(), devices.end(), dst.device.index);
    if (found == devices.end()) {
      devices.push_back(dst.device.index);
      by_device.emplace_back();
      found = devices.end() - 1;
    }
    by_device[found - devices.begin()].push_back({dst.data, src.data, src.nbytes()});
  }
  for (std::size_t d = 0; d < devices.size(); ++d) {
    cuda::copy_many(by_device[d].data(), by_device[d].size(), devices[d], stream);
  }
#else
  for (const auto& [dst, src] : pairs) copy_bytes(dst.data, dst.device, src.data, src.device, src.nbytes(), stream);
#endif
}

void write_rows(const TensorRef& cache, const TensorRef& rows, const TensorRef& positions,
                const std::optional<TensorRef>& counts, std::int64_t axis,
                std::uintptr_t stream) {
  const char* op = "write_rows";
  NamedTensor cache_arg{"cache", cache}, rows_arg{"rows", rows},
      positions_arg{"positions", positions};
  if (cache.dtype != DType::kFloat32 && cache.dtype != DType::kFloat16 &&
      cache.dtype != DType::kBFloat16) {
    throw DTypeError(std::string(op) + ": cache must be float32, float16 or bfloat16, got " +
                     dtype_name(cache.dtype));
  }
  if (rows.dtype != cache.dtype) {
    throw DTypeError(std::string(op) + ": rows must have the cache's dtype " +
                     dtype_name(cache.dtype) + ", got " + dtype_name(rows.dtype));
  }
  require_dtype(op, positions_arg, DType::kInt64);
  if (counts) require_dtype(op, NamedTensor{"counts", *counts}, DType::kInt64);

  const std::int64_t rank = static_cast<std::int64_t>(cache.ndim());
  if (rank < 2) {
    throw std::invalid_argument(std::string(op) + ": cache must be [B, ..., L, ...] with a "
                                "position axis after the batch axis (rank >= 2), got shape " +
                                shape_to_string(cache.shape));
  }
  const std::int64_t position_axis = axis < 0 ? axis + rank : axis;
  if (position_axis < 1 || position_axis >= rank) {
    throw std::invalid_argument(
        std::string(op) + ": axis=" + std::to_string(axis) + " is not a position axis of cache " +
        shape_to_string(cache.shape) + " (rank " + std::to_string(rank) + "): use 1.." +
        std::to_string(rank - 1) + ", or -" + std::to_string(rank - 1) +
        "..-1 from the end (axis 0 is the batch)");
  }
  require_rank(op, positions_arg, 2, "[B, M]");
  const std::int64_t batch = cache.shape[0], num_rows = positions.shape[1];
  require_shape(op, positions_arg, {batch, num_rows}, "[B, M]");
  Shape expected_rows = cache.shape;
  expected_rows[position_axis] = num_rows;
  require_shape(op, rows_arg, expected_rows,
                "cache.shape with axis " + std::to_string(position_axis) +
                    " (the positions) of length M=" + std::to_string(num_rows));
  if (counts) require_shape(op, NamedTensor{"counts", *counts}, {batch}, "[B]");
  Device device = counts ? require_one_device(op, {cache_arg, rows_arg, positions_arg,
                                                   NamedTensor{"counts", *counts}})
                         : require_one_device(op, {cache_arg, rows_arg, positions_arg});

  // cache [B, P, L, Q], rows [B, P, M, Q]; a row is the Q elements after the axis.
  std::int64_t outer = 1, inner = 1;
  for (std::int64_t d = 1; d < position_axis; ++d) outer *= cache.shape[d];
  for (std::int64_t d = position_axis + 1; d < rank; ++d) inner *= cache.shape[d];
  const std::int64_t cache_length = cache.shape[position_axis];
  const std::size_t row_bytes = static_cast<std::size_t>(inner) * dtype_size(cache.dtype);
  const std::int64_t* counts_data = counts ? counts->as<std::int64_t>() : nullptr;
  if (!device.is_cuda()) {
    cpu::write_rows(cache.data, rows.data, positions.as<std::int64_t>(), counts_data, batch,
                    outer, cache_length, num_rows, row_bytes);
    return;
  }
#ifdef ORTSPEC_WITH_CUDA
  cuda::write_rows(cache.data, rows.data, positions.as<std::int64_t>(), counts_data, batch,
                   outer, cache_length, num_rows, row_bytes, device.index, stream);
#else
  (void)stream;
  unreachable_cuda();
#endif
}

void gather_rows(const TensorRef& src, const TensorRef& index, const TensorRef& dst,
                 std::uintptr_t stream) {
  const char* op = "gather_rows";
  NamedTensor src_arg{"src", src}, index_arg{"index", index}, dst_arg{"dst", dst};
  require_dtype(op, index_arg, DType::kInt64);
  if (dst.dtype != src.dtype) {
    throw DTypeError(std::string(op) + ": dst must have the src's dtype " +
                     dtype_name(src.dtype) + ", got " + dtype_name(dst.dtype));
  }
  if (dst.ndim() < 1) {
    throw std::invalid_argument(std::string(op) + ": dst must be [B, ...] (rank >= 1), got "
                                "shape " + shape_to_string(dst.shape));
  }
  const std::int64_t batch = dst.shape[0];
  const std::int64_t num_rows = src.ndim() >= 2 ? src.shape[1] : 1;
  Shape expected_src = dst.shape;
  expected_src.insert(expected_src.begin() + 1, num_rows);
  require_shape(op, src_arg, expected_src, "[B, M] + dst.shape[1:]");
  require_shape(op, index_arg, {batch}, "[B]");
  Device device = require_one_device(op, {src_arg, index_arg, dst_arg});
  std::size_t row_bytes = batch == 0 ? 0 : dst.nbytes() / static_cast<std::size_t>(batch);
  if (!device.is_cuda()) {
    cpu::gather_rows(src.data, index.as<std::int64_t>(), dst.data, batch, num_rows, row_bytes);
    return;
  }
#ifdef ORTSPEC_WITH_CUDA
  cuda::gather_rows(src.data, index.as<std::int64_t>(), dst.data, batch, num_rows, row_bytes,
                    device.index, stream);
#else
  (void)stream;
  unreachable_cuda();
#endif
}

void advance_decode_inputs(const TensorRef& tokens, const TensorRef& ids, const TensorRef& positions,
                           std::int64_t last_position, std::uintptr_t stream) {
  const char* op = "advance_decode_inputs";
  NamedTensor tokens_arg{"tokens", tokens}, ids_arg{"ids", ids}, positions_arg{"positions", positions};
  for (const NamedTensor& arg : {tokens_arg, ids_arg, positions_arg}) {
    require_dtype(op, arg, DType::kInt64);
    require_rank(op, arg, 2, "[B, 1]");
    require_shape(op, arg, {tokens.shape[0], 1}, "[B, 1]");
  }
  if (last_position < 0) {
    throw std::invalid_argument(std::string(op) + ": last_position must be >= 0, got " +
                                std::to_string(last_position));
  }
  Device device = require_one_device(op, {tokens_arg, ids_arg, positions_arg});
  const std::int64_t batch = tokens.shape[0];
  if (!device.is_cuda()) {
    cpu::advance_decode_inputs(tokens.as<std::int64_t>(), ids.as<std::int64_t>(),
                               positions.as<std::int64_t>(), batch, last_position);
    return;
  }
#ifdef ORTSPEC_WITH_CUDA
  cuda::advance_decode_inputs(tokens.as<std::int64_t>(), ids.as<std::int64_t>(), positions.as<std::int64_t>(),
                              batch, last_position, device.index, stream);
#else
  (void)stream;
  unreachable_cuda();
#endif
}

void advance_speculative_inputs(const TensorRef& step_ids, const TensorRef& ids, const TensorRef& positions,
                                const TensorRef& verified, const TensorRef& counts, std::int64_t last_start,
                                std::uintptr_t stream) {
  const char* op = "advance_speculative_inputs";
  NamedTensor step_ids_arg{"step_ids", step_ids}, ids_arg{"ids", ids}, positions_arg{"positions", positions},
      verified_arg{"verified", verified}, counts_arg{"counts", counts};
  for (const NamedTensor& arg : {step_ids_arg, ids_arg, positions_arg, verified_arg, counts_arg}) {
    require_dtype(op, arg, DType::kInt64);
  }
  require_rank(op, ids_arg, 2, "[B, k+1]");
  const std::int64_t batch = ids.shape[0], k = ids.shape[1] - 1;
  if (k < 1) {
    throw std::invalid_argument(std::string(op) + ": ids must be [B, k+1] with k >= 1, got " +
                                shape_to_string(ids.shape));
  }
  require_shape(op, step_ids_arg, {batch, 2 * k + 2}, "[B, 2k+2]");
  require_shape(op, positions_arg, {batch, k + 1}, "[B, k+1]");
  require_shape(op, verified_arg, {batch, k + 1}, "[B, k+1]");
  require_shape(op, counts_arg, {batch}, "[B]");
  if (last_start < 0) {
    throw std::invalid_argument(std::string(op) + ": last_start must be >= 0, got " + std::to_string(last_start));
  }
  Device device = require_one_device(op, {step_ids_arg, ids_arg, positions_arg, verified_arg, counts_arg});
  if (!device.is_cuda()) {
    cpu::advance_speculative_inputs(step_ids.as<std::int64_t>(), ids.as<std::int64_t>(),
                                    positions.as<std::int64_t>(), verified.as<std::int64_t>(),
                                    counts.as<std::int64_t>(), batch, k, last_start);
    return;
  }
#ifdef ORTSPEC_WITH_CUDA
  cuda::advance_speculative_inputs(step_ids.as<std::int64_t>(), ids.as<std::int64_t>(),
                                   positions.as<std::int64_t>(), verified.as<std::int64_t>(),
                                   counts.as<std::int64_t>(), batch, k, last_start, device.index, stream);
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
