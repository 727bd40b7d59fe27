// The CPU state kernels (the reference for CUDA) against the straightforward
// references in reference.h on random data, plus every validation error.
#include <cstdint>
#include <random>
#include <stdexcept>
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

template <typename T>
TensorRef host_tensor(std::vector<T>& values, DType dtype, ortspec::Shape shape) {
  return TensorRef{values.data(), dtype, std::move(shape), Device::cpu()};
}

TensorRef host_int64(Tokens& values, ortspec::Shape shape) {
  return host_tensor(values, DType::kInt64, std::move(shape));
}

void test_accept_and_gather_match_reference() {
  std::mt19937_64 rng(1234);
  for (std::int64_t batch : {1, 3, 8}) {
    for (std::int64_t num_drafts : {0, 1, 3, 7}) {
      StepTokens step = random_step_tokens(batch, num_drafts, rng);
      Tokens accepted(batch, -5), emitted(batch * (num_drafts + 1), -5);
      ortspec::accept_lengths(host_int64(step.drafts, {batch, num_drafts}),
                              host_int64(step.targets, {batch, num_drafts + 1}),
                              host_int64(accepted, {batch}));
      CHECK(accepted == reference_accept_lengths(step));
      ortspec::gather_accepted_tokens(host_int64(step.drafts, {batch, num_drafts}),
                                      host_int64(step.targets, {batch, num_drafts + 1}),
                                      host_int64(accepted, {batch}),
                                      host_int64(emitted, {batch, num_drafts + 1}));
      CHECK(emitted == reference_gather(step, accepted));
    }
  }
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

void test_copy_and_advance() {
  std::mt19937_64 rng(7);
  std::vector<float> src = random_floats(24, rng), dst(24, 0.0f);
  ortspec::copy_buffer(host_tensor(dst, DType::kFloat32, {2, 12}),
                       host_tensor(src, DType::kFloat32, {2, 12}));
  CHECK(dst == src);

  Tokens positions{10, 0, 5}, accepted{3, 0, 1};
  std::vector<std::int32_t> seq_lens{11, 1, 6};
  ortspec::advance_positions(host_int64(positions, {3}),
                             host_tensor(seq_lens, DType::kInt32, {3}),
                             host_int64(accepted, {3}));
  CHECK((positions == Tokens{14, 1, 7}));
  CHECK((seq_lens == std::vector<std::int32_t>{15, 2, 8}));
}

void test_validation_errors() {
  Tokens drafts(6, 0), targets(8, 0), accepted(2, 0), out(8, 0);
  std::vector<std::int32_t> drafts32(6, 0);
  CHECK_THROWS(ortspec::accept_lengths(host_tensor(drafts32, DType::kInt32, {2, 3}),
                                       host_int64(targets, {2, 4}), host_int64(accepted, {2})),
               ortspec::DTypeError, "accept_lengths: drafts must be int64, got int32");
  CHECK_THROWS(ortspec::accept_lengths(host_int64(drafts, {2, 3}), host_int64(targets, {2, 3}),
                                       host_int64(accepted, {2})),
               std::invalid_argument, "targets must be [B, k+1] = [2, 4], got [2, 3]");
  TensorRef on_gpu = host_int64(targets, {2, 4});
  on_gpu.device = Device::cuda(0);
  CHECK_THROWS(ortspec::accept_lengths(host_int64(drafts, {2, 3}), on_gpu,
                                       host_int64(accepted, {2})),
               std::invalid_argument, "drafts is on cpu, targets on cuda:0");

  std::vector<float> window(3 * 2 * 4), live(2 * 4);
  Tokens bad_index{0, 3};
  CHECK_THROWS(ortspec::select_slots(host_tensor(window, DType::kFloat32, {3, 2, 4}),
                                     host_int64(bad_index, {2}),
                                     host_tensor(live, DType::kFloat32, {2, 4})),
               std::invalid_argument, "index[1]=3 is out of range for a window of W=3");
  Tokens index{0, 1};
  CHECK_THROWS(ortspec::select_slots(host_tensor(window, DType::kFloat32, {3, 2, 4}),
                                     host_int64(index, {2}),
                                     host_tensor(live, DType::kFloat32, {4, 2})),
               std::invalid_argument, "window must be [W] + live.shape = [3, 4, 2]");

  Tokens too_long{0, 4};
  CHECK_THROWS(ortspec::gather_accepted_tokens(host_int64(drafts, {2, 3}),
                                               host_int64(targets, {2, 4}),
                                               host_int64(too_long, {2}),
                                               host_int64(out, {2, 4})),
               std::invalid_argument, "accepted[1]=4 is out of range 0..k=3");
  CHECK_THROWS(ortspec::copy_buffer(host_int64(drafts, {3, 2}), host_int64(drafts, {2, 3})),
               std::invalid_argument, "dst must be src.shape = [2, 3], got [3, 2]");
  Tokens negative{-1, 0}, positions{0, 0}, seq_lens{0, 0};
  CHECK_THROWS(ortspec::advance_positions(host_int64(positions, {2}), host_int64(seq_lens, {2}),
                                          host_int64(negative, {2})),
               std::invalid_argument, "accepted[0]=-1 is negative");
  CHECK_EQ(positions[0], 0);  // nothing written on error
}

}  // namespace

int run_state_kernel_cpu_tests() {
  test_accept_and_gather_match_reference();
  test_select_slots_matches_reference();
  test_copy_and_advance();
  test_validation_errors();
  return 0;
}

}  // namespace ortspec_test
