// The CUDA state kernels against the CPU reference, on the device. Compiled
// only in CUDA builds; without a device the suite prints SKIPPED and returns
// kSkipReturnCode, so ctest lists it as skipped rather than passed.
#include <array>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/arena.h"
#include "core/device_memory.h"
#include "core/state_kernels.h"
#include "core/streams.h"
#include "tests/check.h"
#include "tests/reference.h"
#include "tests/suites.h"

#ifdef ORTSPEC_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace ortspec_test {

#ifndef ORTSPEC_WITH_CUDA

int run_state_kernel_cuda_tests() {
  std::printf("SKIPPED: state_kernels_cuda: this build has no CUDA (nvcc not found or "
              "ORTSPEC_NO_CUDA set at configure time)\n");
  return kSkipReturnCode;
}

#else

namespace {

using ortspec::Buffer;
using ortspec::Device;
using ortspec::DType;
using ortspec::TensorRef;

const Device kGpu = Device::cuda(0);

// A zero-filled device buffer holding a copy of `values`.
template <typename T>
Buffer to_device(ortspec::PersistentBuffers& buffers, const std::string& name,
                 const std::vector<T>& values, DType dtype, ortspec::Shape shape) {
  Buffer buffer = buffers.allocate(name, shape, dtype);
  ortspec::copy_bytes(buffer.ref().data, kGpu, values.data(), Device::cpu(),
                      values.size() * sizeof(T), 0);
  return buffer;
}

template <typename T>
std::vector<T> to_host(const Buffer& buffer) {
  std::vector<T> values(buffer.ref().nbytes() / sizeof(T));
  ortspec::copy_bytes(values.data(), Device::cpu(), buffer.ref().data, kGpu,
                      buffer.ref().nbytes(), 0);
  ortspec::synchronize(kGpu, 0);
  return values;
}

void test_select_and_copy_match_cpu() {
  std::mt19937_64 rng(5);
  // 16-byte rows (uint4 path), odd fp16 rows (2-byte path), and a large fp32 state.
  struct Case { std::int64_t slots, batch, features; DType dtype; };
  for (Case c : {Case{4, 3, 8, DType::kFloat32}, Case{5, 7, 3, DType::kFloat16},
                 Case{4, 2, 16 * 128 * 128, DType::kFloat32}}) {
    ortspec::PersistentBuffers device(kGpu);
    std::size_t element = ortspec::dtype_size(c.dtype);
    std::size_t words = c.slots * c.batch * c.features * element / 2;
    std::vector<std::uint16_t> window(words);
    for (std::uint16_t& word : window) word = static_cast<std::uint16_t>(rng());
    Tokens index = random_indices(c.batch, c.slots, rng);
    Buffer window_gpu = to_device(device, "window", window, c.dtype, {c.slots, c.batch, c.features});
    Buffer index_gpu = to_device(device, "index", index, DType::kInt64, {c.batch});
    Buffer live_gpu = device.allocate("live", {c.batch, c.features}, c.dtype);
    ortspec::select_slots(window_gpu.ref(), index_gpu.ref(), live_gpu.ref());
    std::int64_t words_per_row = c.features * static_cast<std::int64_t>(element) / 2;
    CHECK(to_host<std::uint16_t>(live_gpu) == reference_select(window, index, c.batch, words_per_row));

    Buffer snapshot = device.allocate("snapshot", {c.batch, c.features}, c.dtype);
    ortspec::copy_buffer(snapshot.ref(), live_gpu.ref());  // device to device
    CHECK(to_host<std::uint16_t>(snapshot) == to_host<std::uint16_t>(live_gpu));
  }
}

void test_bad_indices_are_recorded_and_reported() {
  ortspec::PersistentBuffers device(kGpu);
  Tokens index{0, 9};
  Buffer window = device.allocate("window", {3, 2, 4}, DType::kFloat32);
  Buffer index_gpu = to_device(device, "index", index, DType::kInt64, {2});
  Buffer live = device.allocate("live", {2, 4}, DType::kFloat32);
  ortspec::select_slots(window.ref(), index_gpu.ref(), live.ref());
  std::string error = ortspec::take_kernel_error(kGpu, 0);
  CHECK(error.find("index[1]=9 is out of range for a window of W=3") != std::string::npos);
  CHECK(ortspec::take_kernel_error(kGpu, 0).empty());  // reading clears it
}

template <typename Bits>
std::vector<Bits> random_bits(std::size_t count, std::mt19937_64& rng) {
  std::vector<Bits> values(count);
  for (Bits& value : values) value = static_cast<Bits>(rng());
  return values;
}

TensorRef host_ref(void* data, DType dtype, ortspec::Shape shape) {
  return TensorRef{data, dtype, std::move(shape), Device::cpu()};
}

// Runs write_rows on the device and the CPU kernel on host copies of the same
// inputs; the caches must agree bitwise. `misalign` elements shift both the
// cache and the rows off their 256-byte boundary (narrower device words).
template <typename Bits>
void check_write_rows_matches_cpu(const WriteRowsCase& c, DType dtype, std::mt19937_64& rng,
                                  std::int64_t misalign = 0) {
  ortspec::PersistentBuffers device(kGpu);
  std::vector<Bits> cache = random_bits<Bits>(c.cache_numel() + misalign, rng);
  std::vector<Bits> rows = random_bits<Bits>(c.rows_numel() + misalign, rng);
  Tokens positions = c.positions, counts = c.counts;
  Buffer cache_gpu = to_device(device, "cache", cache, dtype, {c.cache_numel() + misalign});
  Buffer rows_gpu = to_device(device, "rows", rows, dtype, {c.rows_numel() + misalign});
  Buffer positions_gpu = to_device(device, "positions", positions, DType::kInt64,
                                   {c.batch(), c.num_rows});
  std::optional<TensorRef> counts_gpu, counts_host;
  if (!counts.empty()) {
    counts_gpu = to_device(device, "counts", counts, DType::kInt64, {c.batch()}).ref();
    counts_host = host_ref(counts.data(), DType::kInt64, {c.batch()});
  }
  ortspec::write_rows(
      TensorRef{static_cast<Bits*>(cache_gpu.ref().data) + misalign, dtype, c.cache_shape, kGpu},
      TensorRef{static_cast<Bits*>(rows_gpu.ref().data) + misalign, dtype, c.rows_shape(), kGpu},
      positions_gpu.ref(), counts_gpu, c.axis);
  ortspec::write_rows(host_ref(cache.data() + misalign, dtype, c.cache_shape),
                      host_ref(rows.data() + misalign, dtype, c.rows_shape()),
                      host_ref(positions.data(), DType::kInt64, {c.batch(), c.num_rows}),
                      counts_host, c.axis);
  CHECK(to_host<Bits>(cache_gpu) == cache);
}

void test_write_rows_match_cpu() {
  std::mt19937_64 rng(404);
  for (const WriteRowsCase& c : write_rows_cases(rng)) {
    check_write_rows_matches_cpu<std::uint32_t>(c, DType::kFloat32, rng);
    check_write_rows_matches_cpu<std::uint16_t>(c, DType::kFloat16, rng);
    check_write_rows_matches_cpu<std::uint16_t>(c, DType::kBFloat16, rng, /*misalign=*/1);
  }
  // Our layouts at size: a prefill-sized M (2M elements of rows), counts None and
  // partial; hd=128 fp16 rows take the 16-byte path, the key layout 2-byte words.
  for (CountsMode mode : {CountsMode::kNone, CountsMode::kPartial}) {
    check_write_rows_matches_cpu<std::uint16_t>(
        make_write_rows_case({4, 8, 128, 1024}, 3, 512, mode, rng), DType::kFloat16, rng);
    check_write_rows_matches_cpu<std::uint16_t>(
        make_write_rows_case({4, 8, 1024, 128}, 2, 512, mode, rng), DType::kBFloat16, rng);
    check_write_rows_matches_cpu<std::uint32_t>(
        make_write_rows_case({4, 8, 64, 300}, 3, 40, mode, rng), DType::kFloat32, rng);
    check_write_rows_matches_cpu<std::uint32_t>(
        make_write_rows_case({4, 8, 300, 64}, 2, 40, mode, rng), DType::kFloat32, rng);
  }
  CHECK(ortspec::take_kernel_error(kGpu, 0).empty());
}

// A cache of more than INT_MAX words: the kernel's 64-bit index path.
void test_write_rows_past_32_bit_offsets() {
  const std::int64_t length = (std::int64_t{1} << 31) + 16;  // cache [1, L] fp16: 4 GiB
  ortspec::PersistentBuffers device(kGpu);
  Buffer cache = device.allocate("cache", {1, length}, DType::kFloat16);  // zero-filled
  std::vector<std::uint16_t> rows{0x1111, 0x2222, 0x3333, 0x4444};
  Tokens positions{length - 1, std::int64_t{1} << 31, 5, (std::int64_t{1} << 31) - 1};
  Buffer rows_gpu = to_device(device, "rows", rows, DType::kFloat16, {1, 4});
  Buffer positions_gpu = to_device(device, "positions", positions, DType::kInt64, {1, 4});
  ortspec::write_rows(cache.ref(), rows_gpu.ref(), positions_gpu.ref(), std::nullopt, -1);
  auto element = [&](std::int64_t position) {
    std::uint16_t value = 0xFFFF;
    ortspec::copy_bytes(&value, Device::cpu(), cache.ref().as<std::uint16_t>() + position, kGpu,
                        sizeof(value), 0);
    ortspec::synchronize(kGpu, 0);
    return value;
  };
  for (std::size_t j = 0; j < rows.size(); ++j) CHECK_EQ(element(positions[j]), rows[j]);
  CHECK_EQ(element(length - 2), 0);
  CHECK_EQ(element(4), 0);
  CHECK(ortspec::take_kernel_error(kGpu, 0).empty());
}

void test_gather_rows_match_cpu() {
  std::mt19937_64 rng(808);
  struct Case { std::int64_t batch, num_rows; ortspec::Shape features; DType dtype; };
  for (const Case& c : {Case{3, 5, {16}, DType::kFloat32}, Case{1, 1, {2, 3}, DType::kFloat32},
                        Case{4, 3, {}, DType::kFloat16}, Case{2, 6, {3, 1, 5}, DType::kBFloat16},
                        Case{8, 5, {4096}, DType::kFloat32}, Case{5, 4, {3}, DType::kInt64}}) {
    ortspec::PersistentBuffers device(kGpu);
    std::int64_t features = 1;
    for (std::int64_t dim : c.features) features *= dim;
    ortspec::Shape dst_shape{c.batch}, src_shape{c.batch, c.num_rows};
    dst_shape.insert(dst_shape.end(), c.features.begin(), c.features.end());
    src_shape.insert(src_shape.end(), c.features.begin(), c.features.end());
    std::size_t element = ortspec::dtype_size(c.dtype);
    // 16-bit words of every dtype; the kernels copy bitwise.
    std::vector<std::uint16_t> src = random_bits<std::uint16_t>(
        c.batch * c.num_rows * features * element / 2, rng);
    std::vector<std::uint16_t> dst(c.batch * features * element / 2, 0);
    Tokens index = random_indices(c.batch, c.num_rows, rng);
    Buffer src_gpu = to_device(device, "src", src, c.dtype, src_shape);
    Buffer index_gpu = to_device(device, "index", index, DType::kInt64, {c.batch});
    Buffer dst_gpu = device.allocate("dst", dst_shape, c.dtype);
    ortspec::gather_rows(src_gpu.ref(), index_gpu.ref(), dst_gpu.ref());
    ortspec::gather_rows(host_ref(src.data(), c.dtype, src_shape),
                         host_ref(index.data(), DType::kInt64, {c.batch}),
                         host_ref(dst.data(), c.dtype, dst_shape));
    CHECK(to_host<std::uint16_t>(dst_gpu) == dst);
  }
  CHECK(ortspec::take_kernel_error(kGpu, 0).empty());
}

void test_write_and_gather_rows_errors_are_recorded() {
  // cache [2, 1, 4, 2] fp32 (position axis 2) filled with 7; rows [2, 1, 2, 2] = 1..8.
  ortspec::PersistentBuffers device(kGpu);
  std::vector<float> filled(2 * 4 * 2, 7.0f), rows{1, 2, 3, 4, 5, 6, 7, 8};
  Buffer rows_gpu = to_device(device, "rows", rows, DType::kFloat32, {2, 1, 2, 2});
  auto fresh_cache = [&](const std::string& name) {
    return to_device(device, name, filled, DType::kFloat32, {2, 1, 4, 2});
  };
  auto expect = [&](std::vector<std::array<std::int64_t, 3>> writes) {  // {b, j, position}
    std::vector<float> expected = filled;
    for (const auto& [b, j, position] : writes) {
      for (std::int64_t q = 0; q < 2; ++q) expected[(b * 4 + position) * 2 + q] = rows[(b * 2 + j) * 2 + q];
    }
    return expected;
  };

  Tokens positions{0, 1, 2, 3}, too_many{2, 3};
  Buffer positions_gpu = to_device(device, "positions", positions, DType::kInt64, {2, 2});
  Buffer cache = fresh_cache("cache_count");
  ortspec::write_rows(cache.ref(), rows_gpu.ref(), positions_gpu.ref(),
                      to_device(device, "too_many", too_many, DType::kInt64, {2}).ref(), 2);
  CHECK(ortspec::take_kernel_error(kGpu, 0) ==
        "write_rows: counts[1]=3 is out of range 0..M=2; nothing was written for that request");
  CHECK(to_host<float>(cache) == expect({{0, 0, 0}, {0, 1, 1}}));

  Tokens past_end{0, 1, 2, 7};
  cache = fresh_cache("cache_position");
  ortspec::write_rows(cache.ref(), rows_gpu.ref(),
                      to_device(device, "past_end", past_end, DType::kInt64, {2, 2}).ref(),
                      std::nullopt, 2);
  CHECK(ortspec::take_kernel_error(kGpu, 0) ==
        "write_rows: positions[1, 1]=7 is out of range for a cache of L=4 positions (valid "
        "0..3); that row was not written");
  CHECK(to_host<float>(cache) == expect({{0, 0, 0}, {0, 1, 1}, {1, 0, 2}}));

  // Positions past a request's count are never read.
  Tokens padded{3, -1, -1, -1}, one_and_none{1, 0};
  cache = fresh_cache("cache_padded");
  ortspec::write_rows(cache.ref(), rows_gpu.ref(),
                      to_device(device, "padded", padded, DType::kInt64, {2, 2}).ref(),
                      to_device(device, "one_and_none", one_and_none, DType::kInt64, {2}).ref(), 2);
  CHECK(ortspec::take_kernel_error(kGpu, 0).empty());
  CHECK(to_host<float>(cache) == expect({{0, 0, 3}}));

  std::vector<float> src{0, 1, 2, 3, 4, 5}, dst{9, 9};  // src [2, 3], dst [2]
  Tokens bad_index{-1, 2};
  Buffer dst_gpu = to_device(device, "dst", dst, DType::kFloat32, {2});
  ortspec::gather_rows(to_device(device, "src", src, DType::kFloat32, {2, 3}).ref(),
                       to_device(device, "bad_index", bad_index, DType::kInt64, {2}).ref(),
                       dst_gpu.ref());
  CHECK(ortspec::take_kernel_error(kGpu, 0) ==
        "gather_rows: index[0]=-1 is out of range for src of M=3 rows (valid 0..2); that row "
        "of dst was left unchanged");
  CHECK((to_host<float>(dst_gpu) == std::vector<float>{9, 5}));
}

void test_device_arena_pins() {
  auto arena = ortspec::StepScopedArena::create(1 << 20, kGpu);
  Buffer pinned = arena->allocate({256}, DType::kFloat32);
  arena->pin();
  Buffer scratch = arena->allocate({256}, DType::kFloat32);
  arena->reset();
  Buffer again = arena->allocate({256}, DType::kFloat32);
  CHECK(again.ref().data == scratch.unchecked_ref().data);
  CHECK(pinned.is_live() && reinterpret_cast<std::uintptr_t>(pinned.ref().data) % 256 == 0);
}

// Pipeline stages on two GPUs hand their proxies over with copy_buffer: a peer copy
// there. With one GPU it runs the same call between two buffers of that device.
void test_copy_between_devices() {
  int last = ortspec::cuda_device_count() - 1;
  ortspec::PersistentBuffers first(kGpu), second(Device::cuda(last));
  std::vector<float> values(3 * 1024);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = 0.5f * static_cast<float>(i) - 7.0f;
  Buffer src = to_device(first, "proxy", values, DType::kFloat32, {3, 1024});
  Buffer dst = second.allocate("proxy", {3, 1024}, DType::kFloat32);
  ortspec::copy_buffer(dst.ref(), src.ref());
  std::vector<float> back(values.size());
  ortspec::copy_bytes(back.data(), Device::cpu(), dst.ref().data, Device::cuda(last),
                      dst.ref().nbytes(), 0);
  ortspec::synchronize(Device::cuda(last), 0);
  CHECK(back == values);
  std::printf("state_kernels_cuda: copy_buffer cuda:0 -> cuda:%d checked\n", last);
}

// copy_buffers: the 16-byte-aligned same-device pairs go in one kernel launch, the others
// (an odd size, an offset view) one by one; all of them land bitwise.
void test_copy_buffers_in_one_launch() {
  ortspec::PersistentBuffers device(kGpu);
  std::vector<std::pair<ortspec::TensorRef, ortspec::TensorRef>> pairs;
  std::vector<Buffer> keep;
  std::vector<std::vector<std::uint16_t>> expected;
  const std::int64_t sizes[] = {8, 4608, 36864, 3, 70};  // elements: 16 B, ..., 6 B (odd), 140 B
  for (std::size_t i = 0; i < std::size(sizes); ++i) {
    std::vector<std::uint16_t> values(static_cast<std::size_t>(sizes[i]));
    for (std::size_t v = 0; v < values.size(); ++v) values[v] = static_cast<std::uint16_t>(v * 7 + i);
    Buffer src = to_device(device, "src" + std::to_string(i), values, DType::kFloat16, {sizes[i]});
    Buffer dst = device.allocate("dst" + std::to_string(i), {sizes[i]}, DType::kFloat16);
    pairs.emplace_back(dst.ref(), src.ref());
    keep.push_back(dst);
    expected.push_back(values);
  }
  ortspec::copy_buffers(pairs, 0);
  for (std::size_t i = 0; i < keep.size(); ++i) CHECK(to_host<std::uint16_t>(keep[i]) == expected[i]);
}

// advance_decode_inputs on the device equals the CPU reference (a row parked at the end stays).
void test_advance_decode_inputs_match_cpu() {
  ortspec::PersistentBuffers device(kGpu);
  Tokens tokens{7, 9, 4}, ids{0, 0, 0}, positions{5, 62, 63};
  Tokens want_ids = ids, want_positions = positions;
  ortspec::cpu::advance_decode_inputs(tokens.data(), want_ids.data(), want_positions.data(), 3, 63);
  Buffer tokens_gpu = to_device(device, "tokens", tokens, DType::kInt64, {3, 1});
  Buffer ids_gpu = to_device(device, "ids", ids, DType::kInt64, {3, 1});
  Buffer positions_gpu = to_device(device, "positions", positions, DType::kInt64, {3, 1});
  ortspec::advance_decode_inputs(tokens_gpu.ref(), ids_gpu.ref(), positions_gpu.ref(), 63);
  CHECK(to_host<std::int64_t>(ids_gpu) == want_ids);
  CHECK(to_host<std::int64_t>(positions_gpu) == want_positions);
  CHECK((want_positions == Tokens{6, 63, 63}));
}

// advance_speculative_inputs on the device equals the CPU reference (k = 2: a = 0, 2, and a row
// parked at last_start); an accept length out of range is recorded, its row left unchanged.
void test_advance_speculative_inputs_match_cpu() {
  ortspec::PersistentBuffers device(kGpu);
  Tokens step_ids{10, 11, 12, 0, 20, 21,   // a = 0: bonus g_0 = 10
                  30, 31, 32, 2, 40, 41,   // a = 2: bonus g_2 = 32
                  50, 51, 52, 1, 60, 61};  // a = 1, parked at last_start = 61
  Tokens ids(9, 0), positions{5, 6, 7, 9, 10, 11, 60, 61, 62}, verified(9, -1), counts(3, -1);
  Tokens want_ids = ids, want_positions = positions, want_verified = verified, want_counts = counts;
  ortspec::cpu::advance_speculative_inputs(step_ids.data(), want_ids.data(), want_positions.data(),
                                           want_verified.data(), want_counts.data(), 3, 2, 61);
  CHECK((want_ids == Tokens{10, 20, 21, 32, 40, 41, 51, 60, 61}));
  CHECK((want_positions == Tokens{6, 7, 8, 12, 13, 14, 61, 62, 63}));
  CHECK((want_counts == Tokens{1, 3, 2}) && want_verified == positions);
  Buffer step_ids_gpu = to_device(device, "step_ids", step_ids, DType::kInt64, {3, 6});
  Buffer ids_gpu = to_device(device, "ids", ids, DType::kInt64, {3, 3});
  Buffer positions_gpu = to_device(device, "positions", positions, DType::kInt64, {3, 3});
  Buffer verified_gpu = to_device(device, "verified", verified, DType::kInt64, {3, 3});
  Buffer counts_gpu = to_device(device, "counts", counts, DType::kInt64, {3});
  ortspec::advance_speculative_inputs(step_ids_gpu.ref(), ids_gpu.ref(), positions_gpu.ref(), verified_gpu.ref(),
                                      counts_gpu.ref(), 61);
  CHECK(to_host<std::int64_t>(ids_gpu) == want_ids);
  CHECK(to_host<std::int64_t>(positions_gpu) == want_positions);
  CHECK(to_host<std::int64_t>(verified_gpu) == want_verified);
  CHECK(to_host<std::int64_t>(counts_gpu) == want_counts);
  CHECK(ortspec::take_kernel_error(kGpu).empty());
  step_ids[3] = 3;  // row 0 accepts 3 > k = 2
  Buffer bad = to_device(device, "bad", step_ids, DType::kInt64, {3, 6});
  Tokens before = to_host<std::int64_t>(ids_gpu);
  ortspec::advance_speculative_inputs(bad.ref(), ids_gpu.ref(), positions_gpu.ref(), verified_gpu.ref(),
                                      counts_gpu.ref(), 61);
  CHECK(to_host<std::int64_t>(counts_gpu)[0] == 0 && to_host<std::int64_t>(ids_gpu)[0] == before[0]);
  CHECK(ortspec::take_kernel_error(kGpu).find("step_ids[0, 3] (the accept length) = 3") != std::string::npos);
}

// The pipelined greedy loop's pieces: kernels on an ortspec Stream, a device-to-device copy
// feeding the next input, a copy into page-locked memory read after an Event.
void test_stream_event_and_pinned_readback() {
  ortspec::Stream stream(0);
  ortspec::Event event(0);
  CHECK(stream.handle() != 0 && event.done());
  ortspec::PersistentBuffers device(kGpu);
  std::vector<float> window{0, 1, 2, 3, 4, 5, 6, 7};  // [W=2, B=2, 2]
  Tokens index{1, 0};
  Buffer live = device.allocate("live", {2, 2}, DType::kFloat32);
  Buffer fed = device.allocate("fed", {2, 2}, DType::kFloat32);
  Buffer window_gpu = to_device(device, "window", window, DType::kFloat32, {2, 2, 2});
  Buffer index_gpu = to_device(device, "index", index, DType::kInt64, {2});
  ortspec::synchronize(kGpu, 0);  // the uploads ran on stream 0, which our stream does not wait for
  ortspec::select_slots(window_gpu.ref(), index_gpu.ref(), live.ref(), stream.handle());
  ortspec::copy_buffer(fed.ref(), live.ref(), stream.handle());
  Buffer host = ortspec::pinned_host_buffer({2, 2}, DType::kFloat32);
  ortspec::copy_to_host_async(host.ref(), fed.ref(), stream.handle());
  event.record(stream.handle());
  event.synchronize();
  CHECK(event.done() && stream.idle());
  const float* values = host.ref().as<float>();
  CHECK((std::vector<float>(values, values + 4) == std::vector<float>{4, 5, 2, 3}));
  CHECK_THROWS(ortspec::copy_to_host_async(fed.ref(), live.ref(), stream.handle()), std::invalid_argument,
               "copies a CUDA src into a CPU dst");
}

}  // namespace

int run_state_kernel_cuda_tests() {
  if (ortspec::cuda_device_count() == 0) {
    std::printf("SKIPPED: state_kernels_cuda: no CUDA device on this machine (%s)\n",
                ortspec::cuda::no_device_reason().c_str());
    return kSkipReturnCode;
  }
  test_select_and_copy_match_cpu();
  test_bad_indices_are_recorded_and_reported();
  test_device_arena_pins();
  test_write_rows_match_cpu();
  test_write_rows_past_32_bit_offsets();
  test_gather_rows_match_cpu();
  test_write_and_gather_rows_errors_are_recorded();
  test_copy_between_devices();
  test_stream_event_and_pinned_readback();
  test_copy_buffers_in_one_launch();
  test_advance_decode_inputs_match_cpu();
  test_advance_speculative_inputs_match_cpu();
  run_transition_kernel_cuda_tests();
  return 0;
}

#endif  // ORTSPEC_WITH_CUDA

}  // namespace ortspec_test
