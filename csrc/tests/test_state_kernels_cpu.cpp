// The CPU state kernels (the reference for CUDA) against the straightforward
// references in reference.h on random data, plus every validation error.
#include <cstdint>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/state_kernels.h"
#include "tests/check.h"
#include "tests/reference.h"
#include "tests/suites.h"

namespace ortspec_test {
namespace {

using ortspec::Device;
using ortspec::DType;
using ortspec::TensorRef;

TensorRef host_int64(Tokens& values, ortspec::Shape shape) {
  return host_tensor(values, DType::kInt64, std::move(shape));
}

void test_select_slots_matches_reference() {
  std::mt19937_64 rng(99);
  const std::int64_t slots = 5, batch = 3, features = 2 * 4 * 6;  // live [B, 2, 4, 6]
  std::vector<float> window = random_floats(slots * batch * features, rng);
  std::vector<float> live(batch * features, 0.0f);
  Tokens index = random_indices(batch, slots, rng);
  ortspec::select_slots(host_tensor(window, DType::kFloat32, {slots, batch, 2, 4, 6}),
                        host_int64(index, {batch}),
                        host_tensor(live, DType::kFloat32, {batch, 2, 4, 6}));
  CHECK(live == reference_select(window, index, batch, features));

  std::vector<std::uint16_t> half_window(slots * batch * 3), half_live(batch * 3);
  for (std::size_t i = 0; i < half_window.size(); ++i) half_window[i] = static_cast<std::uint16_t>(i);
  ortspec::select_slots(host_tensor(half_window, DType::kFloat16, {slots, batch, 3}),
                        host_int64(index, {batch}),
                        host_tensor(half_live, DType::kFloat16, {batch, 3}));
  CHECK(half_live == reference_select(half_window, index, batch, 3));
}

void test_copy_buffer() {
  std::mt19937_64 rng(7);
  std::vector<float> src = random_floats(24, rng), dst(24, 0.0f);
  ortspec::copy_buffer(host_tensor(dst, DType::kFloat32, {2, 12}),
                       host_tensor(src, DType::kFloat32, {2, 12}));
  CHECK(dst == src);
}

void test_write_rows_matches_reference() {
  std::mt19937_64 rng(31);
  for (const WriteRowsCase& c : write_rows_cases(rng)) {
    Tokens positions = c.positions, counts = c.counts;
    std::optional<TensorRef> counts_ref;
    if (!counts.empty()) counts_ref = host_int64(counts, {c.batch()});
    TensorRef positions_ref = host_int64(positions, {c.batch(), c.num_rows});

    std::vector<float> cache = random_floats(c.cache_numel(), rng);
    std::vector<float> rows = random_floats(c.rows_numel(), rng);
    std::vector<float> expected = reference_write_rows(cache, c.cache_shape, rows, c.positions,
                                                       c.counts, c.axis, c.num_rows);
    ortspec::write_rows(host_tensor(cache, DType::kFloat32, c.cache_shape),
                        host_tensor(rows, DType::kFloat32, c.rows_shape()), positions_ref,
                        counts_ref, c.axis);
    CHECK(cache == expected);

    for (DType half : {DType::kFloat16, DType::kBFloat16}) {  // bit patterns, copied bitwise
      std::vector<std::uint16_t> cache16 = random_bits16(c.cache_numel(), rng);
      std::vector<std::uint16_t> rows16 = random_bits16(c.rows_numel(), rng);
      std::vector<std::uint16_t> expected16 = reference_write_rows(
          cache16, c.cache_shape, rows16, c.positions, c.counts, c.axis, c.num_rows);
      // Negative axis: the same axis counted from the back.
      std::int64_t from_back = c.axis - static_cast<std::int64_t>(c.cache_shape.size());
      ortspec::write_rows(host_tensor(cache16, half, c.cache_shape),
                          host_tensor(rows16, half, c.rows_shape()), positions_ref, counts_ref,
                          half == DType::kFloat16 ? c.axis : from_back);
      CHECK(cache16 == expected16);
    }
  }
}

void test_write_rows_duplicates_keep_the_last() {
  std::vector<float> cache(2 * 4, 0.0f), rows{1, 2, 3, 4, 5, 6};  // cache [2, 4], rows [2, 3]
  Tokens positions{1, 1, 3, 0, 2, 0};
  ortspec::write_rows(host_tensor(cache, DType::kFloat32, {2, 4}),
                      host_tensor(rows, DType::kFloat32, {2, 3}), host_int64(positions, {2, 3}),
                      std::nullopt, 1);
  CHECK((cache == std::vector<float>{0, 2, 0, 3, 6, 0, 5, 0}));
}

void test_gather_rows_matches_reference() {
  std::mt19937_64 rng(77);
  struct Case { std::int64_t batch, num_rows; ortspec::Shape features; };
  for (const Case& c : {Case{3, 5, {16}}, Case{1, 1, {2, 3}}, Case{4, 3, {}}, Case{2, 6, {3, 1, 5}},
                        Case{0, 4, {8}}}) {
    std::int64_t features = 1;
    for (std::int64_t dim : c.features) features *= dim;
    ortspec::Shape dst_shape{c.batch}, src_shape{c.batch, c.num_rows};
    dst_shape.insert(dst_shape.end(), c.features.begin(), c.features.end());
    src_shape.insert(src_shape.end(), c.features.begin(), c.features.end());
    Tokens index = random_indices(c.batch, c.num_rows, rng);

    std::vector<float> src = random_floats(c.batch * c.num_rows * features, rng);
    std::vector<float> dst(c.batch * features, 0.0f);
    ortspec::gather_rows(host_tensor(src, DType::kFloat32, src_shape), host_int64(index, {c.batch}),
                         host_tensor(dst, DType::kFloat32, dst_shape));
    CHECK(dst == reference_gather_rows(src, index, c.batch, c.num_rows, features));

    std::vector<std::uint16_t> src16 = random_bits16(src.size(), rng), dst16(dst.size(), 0);
    ortspec::gather_rows(host_tensor(src16, DType::kBFloat16, src_shape),
                         host_int64(index, {c.batch}), host_tensor(dst16, DType::kBFloat16, dst_shape));
    CHECK(dst16 == reference_gather_rows(src16, index, c.batch, c.num_rows, features));

    Tokens src64 = random_indices(src.size(), 1 << 30, rng), dst64(dst.size(), 0);
    ortspec::gather_rows(host_int64(src64, src_shape), host_int64(index, {c.batch}),
                         host_int64(dst64, dst_shape));
    CHECK(dst64 == reference_gather_rows(src64, index, c.batch, c.num_rows, features));
  }
}

void test_write_and_gather_rows_errors() {
  std::vector<float> cache(2 * 3 * 4, 7.0f), rows(2 * 3 * 2, 1.0f);  // cache [2, 3, 4], rows [2, 3, 2]
  std::vector<std::uint16_t> half_rows(2 * 3 * 2);
  Tokens cache64(2 * 3 * 4), positions{0, 1, 2, 3}, counts{2, 1}, counts3{2, 1, 0};
  std::vector<std::int32_t> positions32(4), counts32(2);
  TensorRef cache_ref = host_tensor(cache, DType::kFloat32, {2, 3, 4});
  TensorRef rows_ref = host_tensor(rows, DType::kFloat32, {2, 3, 2});
  TensorRef positions_ref = host_int64(positions, {2, 2});
  const char* no_rows_for_axis = "rows must be cache.shape with axis 2 (the positions) of length "
                                 "M=2 = [2, 3, 2], got [2, 3, 4]";

  CHECK_THROWS(ortspec::write_rows(host_int64(cache64, {2, 3, 4}), rows_ref, positions_ref,
                                   std::nullopt, 2),
               ortspec::DTypeError, "write_rows: cache must be float32, float16 or bfloat16, got int64");
  CHECK_THROWS(ortspec::write_rows(cache_ref, host_tensor(half_rows, DType::kFloat16, {2, 3, 2}),
                                   positions_ref, std::nullopt, 2),
               ortspec::DTypeError, "write_rows: rows must have the cache's dtype float32, got float16");
  CHECK_THROWS(ortspec::write_rows(cache_ref, rows_ref,
                                   host_tensor(positions32, DType::kInt32, {2, 2}), std::nullopt, 2),
               ortspec::DTypeError, "write_rows: positions must be int64, got int32");
  CHECK_THROWS(ortspec::write_rows(cache_ref, rows_ref, positions_ref,
                                   host_tensor(counts32, DType::kInt32, {2}), 2),
               ortspec::DTypeError, "write_rows: counts must be int64, got int32");
  CHECK_THROWS(ortspec::write_rows(host_tensor(cache, DType::kFloat32, {24}), rows_ref,
                                   positions_ref, std::nullopt, 1),
               std::invalid_argument, "cache must be [B, ..., L, ...] with a position axis after "
                                      "the batch axis (rank >= 2), got shape [24]");
  for (std::int64_t bad_axis : {0, 3, -3}) {
    CHECK_THROWS(ortspec::write_rows(cache_ref, rows_ref, positions_ref, std::nullopt, bad_axis),
                 std::invalid_argument,
                 "write_rows: axis=" + std::to_string(bad_axis) +
                     " is not a position axis of cache [2, 3, 4] (rank 3): use 1..2, or -2..-1 "
                     "from the end (axis 0 is the batch)");
  }
  CHECK_THROWS(ortspec::write_rows(cache_ref, rows_ref, host_int64(positions, {4}), std::nullopt, 2),
               std::invalid_argument, "positions must be [B, M] (rank 2), got shape [4]");
  CHECK_THROWS(ortspec::write_rows(cache_ref, rows_ref, host_int64(positions, {4, 1}), std::nullopt, 2),
               std::invalid_argument, "positions must be [B, M] = [2, 1], got [4, 1]");
  CHECK_THROWS(ortspec::write_rows(cache_ref, host_tensor(rows, DType::kFloat32, {2, 2, 3}),
                                   positions_ref, std::nullopt, 2),
               std::invalid_argument, "rows must be cache.shape with axis 2 (the positions) of "
                                      "length M=2 = [2, 3, 2], got [2, 2, 3]");
  CHECK_THROWS(ortspec::write_rows(cache_ref, cache_ref, positions_ref, std::nullopt, 2),
               std::invalid_argument, no_rows_for_axis);
  CHECK_THROWS(ortspec::write_rows(cache_ref, rows_ref, positions_ref, host_int64(counts3, {3}), 2),
               std::invalid_argument, "write_rows: counts must be [B] = [2], got [3]");
  TensorRef rows_on_gpu = rows_ref;
  rows_on_gpu.device = Device::cuda(0);
  CHECK_THROWS(ortspec::write_rows(cache_ref, rows_on_gpu, positions_ref, std::nullopt, 2),
               std::invalid_argument, "cache is on cpu, rows on cuda:0");
  TensorRef counts_on_gpu = host_int64(counts, {2});
  counts_on_gpu.device = Device::cuda(0);
  CHECK_THROWS(ortspec::write_rows(cache_ref, rows_ref, positions_ref, counts_on_gpu, 2),
               std::invalid_argument, "cache is on cpu, counts on cuda:0");

  // Data errors name the entry and write nothing.
  Tokens too_many{2, 3}, negative_count{-1, 0};
  CHECK_THROWS(ortspec::write_rows(cache_ref, rows_ref, positions_ref, host_int64(too_many, {2}), 2),
               std::invalid_argument, "write_rows: counts[1]=3 is out of range 0..M=2");
  CHECK_THROWS(ortspec::write_rows(cache_ref, rows_ref, positions_ref,
                                   host_int64(negative_count, {2}), 2),
               std::invalid_argument, "write_rows: counts[0]=-1 is out of range 0..M=2");
  Tokens past_end{0, 1, 2, 4}, before_start{0, -3, 1, 2};
  CHECK_THROWS(ortspec::write_rows(cache_ref, rows_ref, host_int64(past_end, {2, 2}), std::nullopt, 2),
               std::invalid_argument,
               "write_rows: positions[1, 1]=4 is out of range for a cache of L=4 positions (valid 0..3)");
  CHECK_THROWS(ortspec::write_rows(cache_ref, rows_ref, host_int64(before_start, {2, 2}),
                                   std::nullopt, 2),
               std::invalid_argument, "positions[0, 1]=-3 is out of range for a cache of L=4");
  CHECK(cache == std::vector<float>(2 * 3 * 4, 7.0f));
  // Positions past a request's count are never read: -3 there is fine.
  Tokens one_each{1, 2};
  ortspec::write_rows(cache_ref, rows_ref, host_int64(before_start, {2, 2}),
                      host_int64(one_each, {2}), 2);
  CHECK_EQ(cache[0], 1.0f);  // cache[0, 0, 0] = rows[0, 0, 0]
  CHECK_EQ(cache[1], 7.0f);

  std::vector<float> src(2 * 4 * 3), dst(2 * 3, 5.0f);
  std::vector<std::uint16_t> dst16(2 * 3);
  Tokens index{0, 3}, bad_index{1, 4};
  std::vector<std::int32_t> index32{0, 1};
  TensorRef src_ref = host_tensor(src, DType::kFloat32, {2, 4, 3});
  TensorRef dst_ref = host_tensor(dst, DType::kFloat32, {2, 3});
  CHECK_THROWS(ortspec::gather_rows(src_ref, host_tensor(index32, DType::kInt32, {2}), dst_ref),
               ortspec::DTypeError, "gather_rows: index must be int64, got int32");
  CHECK_THROWS(ortspec::gather_rows(src_ref, host_int64(index, {2}),
                                    host_tensor(dst16, DType::kFloat16, {2, 3})),
               ortspec::DTypeError, "gather_rows: dst must have the src's dtype float32, got float16");
  CHECK_THROWS(ortspec::gather_rows(src_ref, host_int64(index, {2}),
                                    host_tensor(dst, DType::kFloat32, {})),
               std::invalid_argument, "gather_rows: dst must be [B, ...] (rank >= 1), got shape []");
  CHECK_THROWS(ortspec::gather_rows(host_tensor(src, DType::kFloat32, {2, 12}),
                                    host_int64(index, {2}), dst_ref),
               std::invalid_argument, "src must be [B, M] + dst.shape[1:] = [2, 12, 3], got [2, 12]");
  CHECK_THROWS(ortspec::gather_rows(src_ref, host_int64(index, {2}),
                                    host_tensor(dst, DType::kFloat32, {3, 2})),
               std::invalid_argument, "src must be [B, M] + dst.shape[1:] = [3, 4, 2], got [2, 4, 3]");
  CHECK_THROWS(ortspec::gather_rows(src_ref, host_int64(index, {1}), dst_ref),
               std::invalid_argument, "gather_rows: index must be [B] = [2], got [1]");
  CHECK_THROWS(ortspec::gather_rows(src_ref, host_int64(bad_index, {2}), dst_ref),
               std::invalid_argument,
               "gather_rows: index[1]=4 is out of range for src of M=4 rows (valid 0..3)");
  CHECK(dst == std::vector<float>(2 * 3, 5.0f));
}

void test_validation_errors() {
  std::vector<float> window(3 * 2 * 4), live(2 * 4, 7.0f);
  std::vector<std::int32_t> index32{0, 1};
  Tokens index{0, 1};
  CHECK_THROWS(ortspec::select_slots(host_tensor(window, DType::kFloat32, {3, 2, 4}),
                                     host_tensor(index32, DType::kInt32, {2}),
                                     host_tensor(live, DType::kFloat32, {2, 4})),
               ortspec::DTypeError, "select_slots: index must be int64, got int32");
  TensorRef live_on_gpu = host_tensor(live, DType::kFloat32, {2, 4});
  live_on_gpu.device = Device::cuda(0);
  CHECK_THROWS(ortspec::select_slots(host_tensor(window, DType::kFloat32, {3, 2, 4}),
                                     host_int64(index, {2}), live_on_gpu),
               std::invalid_argument, "window is on cpu, live on cuda:0");

  Tokens bad_index{0, 3};
  CHECK_THROWS(ortspec::select_slots(host_tensor(window, DType::kFloat32, {3, 2, 4}),
                                     host_int64(bad_index, {2}),
                                     host_tensor(live, DType::kFloat32, {2, 4})),
               std::invalid_argument, "index[1]=3 is out of range for a window of W=3");
  CHECK(live == std::vector<float>(2 * 4, 7.0f));  // nothing written on error
  CHECK_THROWS(ortspec::select_slots(host_tensor(window, DType::kFloat32, {3, 2, 4}),
                                     host_int64(index, {2}),
                                     host_tensor(live, DType::kFloat32, {4, 2})),
               std::invalid_argument, "window must be [W] + live.shape = [3, 4, 2]");
  Tokens tokens(6, 0);
  CHECK_THROWS(ortspec::copy_buffer(host_int64(tokens, {3, 2}), host_int64(tokens, {2, 3})),
               std::invalid_argument, "dst must be src.shape = [2, 3], got [3, 2]");
}

}  // namespace

int run_state_kernel_cpu_tests() {
  test_select_slots_matches_reference();
  test_copy_buffer();
  test_validation_errors();
  test_write_rows_matches_reference();
  test_write_rows_duplicates_keep_the_last();
  test_gather_rows_matches_reference();
  test_write_and_gather_rows_errors();
  run_transition_kernel_cpu_tests();
  return 0;
}

}  // namespace ortspec_test
