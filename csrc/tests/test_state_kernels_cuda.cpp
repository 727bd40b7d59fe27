// The CUDA state kernels against the CPU reference, on the device. Compiled
// only in CUDA builds; without a device the suite prints SKIPPED and returns
// kSkipReturnCode, so ctest lists it as skipped rather than passed.
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/device_memory.h"
#include "core/state_kernels.h"
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

void test_accept_gather_advance_match_cpu() {
  std::mt19937_64 rng(2024);
  for (std::int64_t batch : {1, 5, 300}) {
    for (std::int64_t num_drafts : {0, 1, 4}) {
      ortspec::PersistentBuffers device(kGpu);
      StepTokens step = random_step_tokens(batch, num_drafts, rng);
      Buffer drafts = to_device(device, "drafts", step.drafts, DType::kInt64, {batch, num_drafts});
      Buffer targets = to_device(device, "targets", step.targets, DType::kInt64, {batch, num_drafts + 1});
      Buffer accepted = device.allocate("accepted", {batch}, DType::kInt64);
      Buffer emitted = device.allocate("emitted", {batch, num_drafts + 1}, DType::kInt64);
      ortspec::accept_lengths(drafts.ref(), targets.ref(), accepted.ref());
      ortspec::gather_accepted_tokens(drafts.ref(), targets.ref(), accepted.ref(), emitted.ref());
      Tokens expected_accepted = reference_accept_lengths(step);
      CHECK(to_host<std::int64_t>(accepted) == expected_accepted);
      CHECK(to_host<std::int64_t>(emitted) == reference_gather(step, expected_accepted));

      Tokens positions = random_indices(batch, 1000, rng);
      std::vector<std::int32_t> seq_lens(positions.begin(), positions.end());
      Buffer positions_gpu = to_device(device, "positions", positions, DType::kInt64, {batch});
      Buffer seq_lens_gpu = to_device(device, "seq_lens", seq_lens, DType::kInt32, {batch});
      ortspec::advance_positions(positions_gpu.ref(), seq_lens_gpu.ref(), accepted.ref());
      ortspec::cpu::advance_positions(positions.data(), seq_lens.data(), expected_accepted.data(), batch);
      CHECK(to_host<std::int64_t>(positions_gpu) == positions);
      CHECK(to_host<std::int32_t>(seq_lens_gpu) == seq_lens);
    }
  }
  CHECK(ortspec::take_kernel_error(kGpu, 0).empty());
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

  Tokens too_long{5};
  Tokens drafts{1, 2}, targets{1, 2, 3};
  Buffer drafts_gpu = to_device(device, "drafts", drafts, DType::kInt64, {1, 2});
  Buffer targets_gpu = to_device(device, "targets", targets, DType::kInt64, {1, 3});
  Buffer accepted_gpu = to_device(device, "accepted", too_long, DType::kInt64, {1});
  Buffer out = device.allocate("out", {1, 3}, DType::kInt64);
  ortspec::gather_accepted_tokens(drafts_gpu.ref(), targets_gpu.ref(), accepted_gpu.ref(), out.ref());
  CHECK(ortspec::take_kernel_error(kGpu, 0).find("accepted[0]=5 is out of range 0..k=2") !=
        std::string::npos);
  CHECK((to_host<std::int64_t>(out) == Tokens{-1, -1, -1}));
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

}  // namespace

int run_state_kernel_cuda_tests() {
  if (ortspec::cuda_device_count() == 0) {
    std::printf("SKIPPED: state_kernels_cuda: no CUDA device on this machine (%s)\n",
                ortspec::cuda::no_device_reason().c_str());
    return kSkipReturnCode;
  }
  test_accept_gather_advance_match_cpu();
  test_select_and_copy_match_cpu();
  test_bad_indices_are_recorded_and_reported();
  test_device_arena_pins();
  return 0;
}

#endif  // ORTSPEC_WITH_CUDA

}  // namespace ortspec_test
