// The transition commit (core/transition_kernels.h): the CPU reference against the float64
// recurrence of transition_reference.h and its validation errors (in the state_kernels_cpu
// suite), and the CUDA kernels against the CPU reference on the device (state_kernels_cuda).
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/transition_kernels.h"
#include "tests/check.h"
#include "tests/suites.h"
#include "tests/transition_reference.h"

#ifdef ORTSPEC_WITH_CUDA
#include "core/arena.h"
#include "core/device_memory.h"
#include "core/state_kernels.h"
#endif

namespace ortspec_test {
namespace {

using ortspec::Device;
using ortspec::DType;
using ortspec::TensorRef;
using ortspec::TransitionShape;

ortspec::TransitionLayer host_layer(TransitionCase& c, std::vector<float>& state) {
  return {host_tensor(state, DType::kFloat32, c.state_shape()), host_tensor(c.keys, DType::kFloat32, c.keys_shape()),
          host_tensor(c.values, DType::kFloat32, c.values_shape()), host_tensor(c.decay, DType::kFloat32, c.gate_shape()),
          host_tensor(c.beta, DType::kFloat32, c.gate_shape())};
}

// B, M, nk, nv, dk, dv: equal heads, inverse GQA (nv = 2 nk), odd sizes, one request.
const TransitionShape kShapes[] = {{3, 4, 2, 2, 8, 16}, {4, 5, 2, 4, 16, 8}, {2, 3, 1, 3, 5, 7}, {1, 2, 1, 1, 4, 4}};

void test_replay_matches_the_float64_recurrence() {
  std::mt19937_64 rng(23);
  for (const TransitionShape& shape : kShapes) {
    TransitionCase c = make_transition_case(shape, rng), d = make_transition_case(shape, rng);
    std::vector<float> first = c.state, second = d.state;
    d.counts = c.counts;  // one counts for every layer of a call
    ortspec::replay_transitions({host_layer(c, first), host_layer(d, second)},
                                host_tensor(c.counts, DType::kInt64, {shape.batch}));
    CHECK(relative_error(first, reference_replay(c)) < 1e-6);
    CHECK(relative_error(second, reference_replay(d)) < 1e-6);
    const std::int64_t head_block = shape.value_heads * shape.key_dim * shape.value_dim;  // one request's state
    if (shape.batch > 1) {  // request 1 replays no row: its state is untouched
      CHECK(std::vector<float>(first.begin() + head_block, first.begin() + 2 * head_block) ==
            std::vector<float>(c.state.begin() + head_block, c.state.begin() + 2 * head_block));
    }
  }
}

void test_conv_tails_keep_the_last_inputs() {
  std::mt19937_64 rng(29);
  const std::int64_t batch = 4, tail_rows = 3, num_rows = 5, channels = 6;
  for (Tokens counts : {Tokens{0, 1, 2, 5}, Tokens{5, 4, 3, 0}}) {
    std::vector<float> tail = random_floats(batch * tail_rows * channels, rng);
    std::vector<float> inputs = random_floats(batch * num_rows * channels, rng), committed = tail;
    ortspec::commit_conv_tails({{host_tensor(committed, DType::kFloat32, {batch, tail_rows, channels}),
                                 host_tensor(inputs, DType::kFloat32, {batch, num_rows, channels})}},
                               host_tensor(counts, DType::kInt64, {batch}));
    CHECK(committed == reference_conv_tail(tail, inputs, counts, tail_rows, num_rows, channels));
  }
}

void test_transition_errors_name_the_layer_and_write_nothing() {
  std::mt19937_64 rng(31);
  TransitionCase c = make_transition_case({2, 3, 1, 2, 4, 4}, rng);
  std::vector<float> state = c.state;
  TensorRef counts = host_tensor(c.counts, DType::kInt64, {2});
  ortspec::TransitionLayer good = host_layer(c, state), short_keys = good;
  short_keys.keys.shape = {2, 2, 1, 4};
  CHECK_THROWS(ortspec::replay_transitions({good, short_keys}, counts), std::invalid_argument,
               "replay_transitions: layer 1: keys must be [B, M, nk, dk] = [2, 3, 1, 4], got [2, 2, 1, 4]");
  ortspec::TransitionLayer int_decay = good;
  int_decay.decay.dtype = DType::kInt32;
  CHECK_THROWS(ortspec::replay_transitions({int_decay}, counts), ortspec::DTypeError,
               "replay_transitions: layer 0: decay must be float32, got int32");
  ortspec::TransitionLayer odd_heads = good;
  odd_heads.keys.shape = {2, 3, 3, 4};
  CHECK_THROWS(ortspec::replay_transitions({odd_heads}, counts), std::invalid_argument,
               "nv=2 value heads must be a multiple of the keys' nk=3 key heads");
  Tokens too_many{1, 4};
  CHECK_THROWS(ortspec::replay_transitions({good}, host_tensor(too_many, DType::kInt64, {2})), std::invalid_argument,
               "replay_transitions: counts[1]=4 is out of range 0..M=3 (the verify's rows); nothing was written");
  CHECK(state == c.state);
  std::vector<float> tail(2 * 3 * 4), inputs(2 * 3 * 4);
  CHECK_THROWS(ortspec::commit_conv_tails({{host_tensor(tail, DType::kFloat32, {2, 3, 4}),
                                            host_tensor(inputs, DType::kFloat32, {2, 3, 5})}}, counts),
               std::invalid_argument, "commit_conv_tails: layer 0: inputs must be [B, M, C] = [2, 3, 4], got [2, 3, 5]");
  CHECK_THROWS(ortspec::commit_conv_tails({{host_tensor(tail, DType::kFloat32, {2, 3, 4}),
                                            host_tensor(inputs, DType::kFloat32, {2, 3, 4})}},
                                          host_tensor(too_many, DType::kInt64, {2})),
               std::invalid_argument, "commit_conv_tails: counts[1]=4 is out of range 0..M=3");
}

}  // namespace

void run_transition_kernel_cpu_tests() {
  test_replay_matches_the_float64_recurrence();
  test_conv_tails_keep_the_last_inputs();
  test_transition_errors_name_the_layer_and_write_nothing();
}

#ifdef ORTSPEC_WITH_CUDA

namespace {

const Device kGpu = Device::cuda(0);

ortspec::Buffer upload(ortspec::PersistentBuffers& device, const std::string& name, std::vector<float>& values,
                       ortspec::Shape shape) {
  ortspec::Buffer buffer = device.allocate(name, shape, DType::kFloat32);
  ortspec::copy_bytes(buffer.ref().data, kGpu, values.data(), Device::cpu(), values.size() * sizeof(float), 0);
  return buffer;
}

std::vector<float> download(const ortspec::Buffer& buffer) {
  std::vector<float> values(buffer.ref().nbytes() / sizeof(float));
  ortspec::copy_bytes(values.data(), Device::cpu(), buffer.ref().data, kGpu, buffer.ref().nbytes(), 0);
  ortspec::synchronize(kGpu, 0);
  return values;
}

// Three layers in one launch, the device against the CPU reference (and both against float64):
// the small shapes and Qwen3.5's (dk = dv = 128; 16 value heads, or 32 over 16 key heads).
void test_cuda_replay_matches_cpu() {
  std::mt19937_64 rng(37);
  std::vector<TransitionShape> shapes(std::begin(kShapes), std::end(kShapes));
  shapes.push_back({2, 5, 16, 16, 128, 128});
  shapes.push_back({3, 4, 16, 32, 128, 128});
  shapes.push_back({2, 3, 2, 4, 256, 64});  // the largest dk the kernel holds
  for (const TransitionShape& shape : shapes) {
    ortspec::PersistentBuffers device(kGpu);
    std::vector<TransitionCase> cases;
    std::vector<ortspec::TransitionLayer> on_gpu;
    std::vector<ortspec::Buffer> keep;
    for (int l = 0; l < 3; ++l) {
      cases.push_back(make_transition_case(shape, rng));
      cases[l].counts = cases[0].counts;
    }
    for (int l = 0; l < 3; ++l) {
      TransitionCase& c = cases[l];
      std::string tag = std::to_string(l);
      keep.push_back(upload(device, "state" + tag, c.state, c.state_shape()));
      ortspec::TransitionLayer layer{keep.back().ref(), upload(device, "keys" + tag, c.keys, c.keys_shape()).ref(),
                                     upload(device, "values" + tag, c.values, c.values_shape()).ref(),
                                     upload(device, "decay" + tag, c.decay, c.gate_shape()).ref(),
                                     upload(device, "beta" + tag, c.beta, c.gate_shape()).ref()};
      on_gpu.push_back(layer);
    }
    Tokens counts = cases[0].counts;
    ortspec::Buffer counts_gpu = device.allocate("counts", {shape.batch}, DType::kInt64);
    ortspec::copy_bytes(counts_gpu.ref().data, kGpu, counts.data(), Device::cpu(), counts.size() * 8, 0);
    ortspec::replay_transitions(on_gpu, counts_gpu.ref());
    for (int l = 0; l < 3; ++l) {
      std::vector<float> cpu_state = cases[l].state;
      ortspec::replay_transitions({host_layer(cases[l], cpu_state)}, host_tensor(counts, DType::kInt64, {shape.batch}));
      std::vector<double> cpu_wide(cpu_state.begin(), cpu_state.end());
      std::vector<float> gpu_state = download(keep[l]);
      CHECK(relative_error(gpu_state, cpu_wide) < 1e-5);
      CHECK(relative_error(gpu_state, reference_replay(cases[l])) < 1e-5);
    }
  }
  CHECK(ortspec::take_kernel_error(kGpu, 0).empty());
}

void test_cuda_conv_tails_and_bad_counts() {
  std::mt19937_64 rng(41);
  ortspec::PersistentBuffers device(kGpu);
  const std::int64_t batch = 3, tail_rows = 3, num_rows = 4, channels = 8192;  // Qwen3.5-0.8B's conv channels
  std::vector<float> tail = random_floats(batch * tail_rows * channels, rng);
  std::vector<float> inputs = random_floats(batch * num_rows * channels, rng);
  Tokens counts{4, 0, 2}, bad{1, 5, 2};
  ortspec::Buffer tail_gpu = upload(device, "tail", tail, {batch, tail_rows, channels});
  ortspec::Buffer inputs_gpu = upload(device, "inputs", inputs, {batch, num_rows, channels});
  ortspec::Buffer counts_gpu = device.allocate("counts", {batch}, DType::kInt64);
  ortspec::copy_bytes(counts_gpu.ref().data, kGpu, counts.data(), Device::cpu(), counts.size() * 8, 0);
  ortspec::commit_conv_tails({{tail_gpu.ref(), inputs_gpu.ref()}}, counts_gpu.ref());
  std::vector<float> want = reference_conv_tail(tail, inputs, counts, tail_rows, num_rows, channels);
  CHECK(download(tail_gpu) == want);
  CHECK(ortspec::take_kernel_error(kGpu, 0).empty());

  ortspec::copy_bytes(counts_gpu.ref().data, kGpu, bad.data(), Device::cpu(), bad.size() * 8, 0);
  ortspec::commit_conv_tails({{tail_gpu.ref(), inputs_gpu.ref()}}, counts_gpu.ref());
  std::vector<float> after = download(tail_gpu);
  const std::size_t row = static_cast<std::size_t>(tail_rows * channels);
  CHECK(std::vector<float>(after.begin() + row, after.begin() + 2 * row) ==
        std::vector<float>(want.begin() + row, want.begin() + 2 * row));  // request 1 unchanged
  CHECK(ortspec::take_kernel_error(kGpu, 0) ==
        "commit_conv_tails: counts[1]=5 is out of range 0..M=4 (the verify's rows); that request's conv tail was "
        "left unchanged");
}

}  // namespace

void run_transition_kernel_cuda_tests() {
  test_cuda_replay_matches_cpu();
  test_cuda_conv_tails_and_bad_counts();
}

#endif  // ORTSPEC_WITH_CUDA

}  // namespace ortspec_test
