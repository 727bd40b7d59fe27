// Straightforward references for the state kernels and random inputs for them,
// shared by the CPU and CUDA suites. Written independently of
// core/state_kernels_cpu.cpp (vectors and index arithmetic, no pointers), so a
// bug there does not hide by being copied here.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "core/tensor_ref.h"

namespace ortspec_test {

using Tokens = std::vector<std::int64_t>;

// A host TensorRef over `values` (the tests' own vectors as kernel arguments).
template <typename T>
ortspec::TensorRef host_tensor(std::vector<T>& values, ortspec::DType dtype, ortspec::Shape shape) {
  return ortspec::TensorRef{values.data(), dtype, std::move(shape), ortspec::Device::cpu()};
}

// window [W, B, N] -> live [B, N]
template <typename T>
std::vector<T> reference_select(const std::vector<T>& window, const Tokens& index,
                                std::int64_t batch, std::int64_t features) {
  std::vector<T> live(batch * features);
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t n = 0; n < features; ++n) {
      live[b * features + n] = window.at((index[b] * batch + b) * features + n);
    }
  }
  return live;
}

// Row-major flat offset of a multi-index in `shape`.
inline std::int64_t flat_offset(const std::vector<std::int64_t>& index,
                                const std::vector<std::int64_t>& shape) {
  std::int64_t offset = 0;
  for (std::size_t d = 0; d < shape.size(); ++d) offset = offset * shape[d] + index.at(d);
  return offset;
}

// cache (shape cache_shape, position axis `axis` >= 1) <- rows (cache_shape with
// M at `axis`): for every element of rows with j = its axis coordinate < count(b),
// the same multi-index with j replaced by positions[b, j]. Elements visited in
// row-major order of rows, so a duplicate position keeps its last j. counts
// empty = all M.
template <typename T>
std::vector<T> reference_write_rows(std::vector<T> cache, const std::vector<std::int64_t>& cache_shape,
                                    const std::vector<T>& rows, const Tokens& positions,
                                    const Tokens& counts, std::int64_t axis, std::int64_t num_rows) {
  std::vector<std::int64_t> rows_shape = cache_shape;
  rows_shape.at(axis) = num_rows;
  std::vector<std::int64_t> index(rows_shape.size(), 0);
  for (std::size_t element = 0; element < rows.size(); ++element) {
    std::int64_t rest = static_cast<std::int64_t>(element);  // unravel in rows_shape
    for (std::size_t d = rows_shape.size(); d-- > 0;) {
      index[d] = rest % rows_shape[d];
      rest /= rows_shape[d];
    }
    std::int64_t b = index[0], j = index[axis];
    std::int64_t count = counts.empty() ? num_rows : counts.at(b);
    if (j >= count) continue;
    std::vector<std::int64_t> target = index;
    target[axis] = positions.at(b * num_rows + j);
    cache.at(flat_offset(target, cache_shape)) = rows.at(element);
  }
  return cache;
}

// src [B, M, N] -> dst [B, N], dst[b] = src[b, index[b]]
template <typename T>
std::vector<T> reference_gather_rows(const std::vector<T>& src, const Tokens& index,
                                     std::int64_t batch, std::int64_t num_rows,
                                     std::int64_t features) {
  std::vector<T> dst(batch * features);
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t n = 0; n < features; ++n) {
      dst[b * features + n] = src.at(flat_offset({b, index.at(b), n}, {batch, num_rows, features}));
    }
  }
  return dst;
}

// M distinct positions in 0..L-1 for each of B requests (M <= L), [B, M].
inline Tokens random_distinct_positions(std::int64_t batch, std::int64_t num_rows,
                                        std::int64_t cache_length, std::mt19937_64& rng) {
  Tokens positions;
  for (std::int64_t b = 0; b < batch; ++b) {
    Tokens all(cache_length);
    for (std::int64_t i = 0; i < cache_length; ++i) all[i] = i;
    std::shuffle(all.begin(), all.end(), rng);
    positions.insert(positions.end(), all.begin(), all.begin() + num_rows);
  }
  return positions;
}

// One write_rows call: cache shape, position axis, M new rows per request,
// positions [B, M] (distinct per request) and counts [B] (empty = None).
// Entries past a request's count get position -1, which must be ignored.
enum class CountsMode { kNone, kPartial, kZero };

struct WriteRowsCase {
  std::vector<std::int64_t> cache_shape;
  std::int64_t axis = 1, num_rows = 0;
  Tokens positions, counts;

  std::int64_t batch() const { return cache_shape.at(0); }
  std::int64_t cache_length() const { return cache_shape.at(axis); }
  std::vector<std::int64_t> rows_shape() const {
    std::vector<std::int64_t> shape = cache_shape;
    shape.at(axis) = num_rows;
    return shape;
  }
  std::int64_t cache_numel() const {
    std::int64_t numel = 1;
    for (std::int64_t dim : cache_shape) numel *= dim;
    return numel;
  }
  std::int64_t rows_numel() const { return cache_numel() / cache_length() * num_rows; }
};

inline WriteRowsCase make_write_rows_case(std::vector<std::int64_t> cache_shape, std::int64_t axis,
                                          std::int64_t num_rows, CountsMode mode,
                                          std::mt19937_64& rng) {
  WriteRowsCase c{std::move(cache_shape), axis, num_rows, {}, {}};
  c.positions = random_distinct_positions(c.batch(), num_rows, c.cache_length(), rng);
  if (mode == CountsMode::kNone) return c;
  std::uniform_int_distribution<std::int64_t> pick(0, num_rows);
  for (std::int64_t b = 0; b < c.batch(); ++b) {
    std::int64_t count = mode == CountsMode::kZero ? 0 : pick(rng);
    if (mode == CountsMode::kPartial && b == 0) count = num_rows;  // one full, the rest random
    c.counts.push_back(count);
    for (std::int64_t j = count; j < num_rows; ++j) c.positions[b * num_rows + j] = -1;
  }
  return c;
}

// Random rank 2..5, dims 1..4, L 1..10, axis 1..rank-1, M 0..L.
inline WriteRowsCase random_write_rows_case(CountsMode mode, std::mt19937_64& rng) {
  std::uniform_int_distribution<std::int64_t> rank_pick(2, 5), dim(1, 4), length(1, 10);
  std::int64_t rank = rank_pick(rng);
  std::int64_t axis = std::uniform_int_distribution<std::int64_t>(1, rank - 1)(rng);
  std::vector<std::int64_t> shape(rank);
  for (std::int64_t& size : shape) size = dim(rng);
  shape[axis] = length(rng);
  std::int64_t num_rows = std::uniform_int_distribution<std::int64_t>(0, shape[axis])(rng);
  return make_write_rows_case(std::move(shape), axis, num_rows, mode, rng);
}

// The cases both suites run: our two KV layouts, then random shapes; each with
// counts None, partial and zero.
inline std::vector<WriteRowsCase> write_rows_cases(std::mt19937_64& rng) {
  std::vector<WriteRowsCase> cases;
  for (CountsMode mode : {CountsMode::kNone, CountsMode::kPartial, CountsMode::kZero}) {
    cases.push_back(make_write_rows_case({3, 2, 8, 16}, 3, 5, mode, rng));  // key [B, kvh, hd, L]
    cases.push_back(make_write_rows_case({3, 2, 16, 8}, 2, 5, mode, rng));  // value [B, kvh, L, hd]
    cases.push_back(make_write_rows_case({2, 7}, 1, 7, mode, rng));         // [B, L], every slot
    for (int i = 0; i < 20; ++i) cases.push_back(random_write_rows_case(mode, rng));
  }
  return cases;
}

inline std::vector<std::uint16_t> random_bits16(std::size_t count, std::mt19937_64& rng) {
  std::vector<std::uint16_t> values(count);
  for (std::uint16_t& value : values) value = static_cast<std::uint16_t>(rng());
  return values;
}

inline std::vector<float> random_floats(std::size_t count, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(count);
  for (float& value : values) value = normal(rng);
  return values;
}

inline Tokens random_indices(std::int64_t count, std::int64_t limit, std::mt19937_64& rng) {
  std::uniform_int_distribution<std::int64_t> pick(0, limit - 1);
  Tokens values(count);
  for (std::int64_t& value : values) value = pick(rng);
  return values;
}

}  // namespace ortspec_test
