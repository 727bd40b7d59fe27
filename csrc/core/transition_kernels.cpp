// Validation and device dispatch for the transition commit (see transition_kernels.h).
//
// Layer 0 fixes the shapes and the device; every other layer must match it, so the CPU
// reference loops and the one CUDA launch for all layers see nothing unchecked.
#include "core/transition_kernels.h"

#include <stdexcept>
#include <string>

#include "core/tensor_checks.h"

#ifdef ORTSPEC_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace ortspec {
namespace {

using namespace checks;  // NamedTensor, require_*, unreachable_cuda

std::string layer_op(const char* op, std::size_t layer) {
  return std::string(op) + ": layer " + std::to_string(layer);
}

// The shape of layer 0's record; every layer is checked against it.
TransitionShape transition_shape(const char* op, const TransitionLayer& first) {
  require_rank(op, NamedTensor{"state", first.state}, 4, "[B, nv, dk, dv]");
  require_rank(op, NamedTensor{"keys", first.keys}, 4, "[B, M, nk, dk]");
  const Shape& state = first.state.shape;
  const Shape& keys = first.keys.shape;
  TransitionShape s{state[0], keys[1], keys[2], state[1], state[2], state[3]};
  if (s.key_heads <= 0 || s.value_heads % s.key_heads != 0) {
    throw std::invalid_argument(std::string(op) + ": the state's nv=" + std::to_string(s.value_heads) +
                                " value heads must be a multiple of the keys' nk=" +
                                std::to_string(s.key_heads) + " key heads (keys " + shape_to_string(keys) +
                                ", state " + shape_to_string(state) + ")");
  }
  return s;
}

Device check_transition_layer(const std::string& op, const TransitionLayer& layer, const TransitionShape& s) {
  const char* name = op.c_str();
  NamedTensor state{"state", layer.state}, keys{"keys", layer.keys}, values{"values", layer.values},
      decay{"decay", layer.decay}, beta{"beta", layer.beta};
  for (const NamedTensor& arg : {state, keys, values, decay, beta}) require_dtype(name, arg, DType::kFloat32);
  require_shape(name, state, {s.batch, s.value_heads, s.key_dim, s.value_dim}, "[B, nv, dk, dv]");
  require_shape(name, keys, {s.batch, s.rows, s.key_heads, s.key_dim}, "[B, M, nk, dk]");
  if (layer.values.ndim() == 4) {
    require_shape(name, values, {s.batch, s.rows, s.value_heads, s.value_dim}, "[B, M, nv, dv]");
  } else {
    require_shape(name, values, {s.batch, s.rows, s.value_heads * s.value_dim}, "[B, M, nv*dv]");
  }
  require_shape(name, decay, {s.batch, s.rows, s.value_heads}, "[B, M, nv]");
  require_shape(name, beta, {s.batch, s.rows, s.value_heads}, "[B, M, nv]");
  return require_one_device(name, {state, keys, values, decay, beta});
}

// counts int64 [B] on `device` (the layers' device).
void check_counts(const char* op, const TensorRef& counts, std::int64_t batch, Device device) {
  NamedTensor counts_arg{"counts", counts};
  require_dtype(op, counts_arg, DType::kInt64);
  require_shape(op, counts_arg, {batch}, "[B]");
  if (counts.device != device) {
    throw std::invalid_argument(std::string(op) + ": counts must be on the layers' device " + device.to_string() +
                                ", got " + counts.device.to_string());
  }
}

}  // namespace

void replay_transitions(const std::vector<TransitionLayer>& layers, const TensorRef& counts,
                        std::uintptr_t stream) {
  const char* op = "replay_transitions";
  if (layers.empty()) return;
  const TransitionShape s = transition_shape(op, layers[0]);
  Device device = check_transition_layer(layer_op(op, 0), layers[0], s);
  for (std::size_t l = 1; l < layers.size(); ++l) {
    if (check_transition_layer(layer_op(op, l), layers[l], s) != device) {
      throw std::invalid_argument(layer_op(op, l) + ": on " + layers[l].state.device.to_string() +
                                  ", layer 0 on " + device.to_string() + "; one call per device");
    }
  }
  check_counts(op, counts, s.batch, device);
  if (!device.is_cuda()) {
    for (const TransitionLayer& layer : layers) {
      cpu::replay_transitions(layer.state.as<float>(), layer.keys.as<float>(), layer.values.as<float>(),
                              layer.decay.as<float>(), layer.beta.as<float>(), counts.as<std::int64_t>(), s);
    }
    return;
  }
#ifdef ORTSPEC_WITH_CUDA
  if (s.key_dim > kMaxCudaTransitionKeyDim) {
    throw std::invalid_argument(std::string(op) + ": dk=" + std::to_string(s.key_dim) + " exceeds " +
                                std::to_string(kMaxCudaTransitionKeyDim) + ", the most the CUDA kernel holds");
  }
  std::vector<cuda::TransitionPointers> pointers;
  for (const TransitionLayer& layer : layers) {
    pointers.push_back({layer.state.as<float>(), layer.keys.as<float>(), layer.values.as<float>(),
                        layer.decay.as<float>(), layer.beta.as<float>()});
  }
  cuda::replay_transitions(pointers.data(), pointers.size(), counts.as<std::int64_t>(), s, device.index, stream);
#else
  (void)stream;
  unreachable_cuda();
#endif
}

void commit_conv_tails(const std::vector<ConvTailLayer>& layers, const TensorRef& counts, std::uintptr_t stream) {
  const char* op = "commit_conv_tails";
  if (layers.empty()) return;
  require_rank(op, NamedTensor{"tail", layers[0].tail}, 3, "[B, K-1, C]");
  require_rank(op, NamedTensor{"inputs", layers[0].inputs}, 3, "[B, M, C]");
  const Shape tail_shape = layers[0].tail.shape;
  const std::int64_t batch = tail_shape[0], num_rows = layers[0].inputs.shape[1];
  Device device = layers[0].tail.device;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const std::string name = layer_op(op, l);
    NamedTensor tail{"tail", layers[l].tail}, inputs{"inputs", layers[l].inputs};
    require_dtype(name.c_str(), tail, DType::kFloat32);
    require_dtype(name.c_str(), inputs, DType::kFloat32);
    require_shape(name.c_str(), tail, tail_shape, "layer 0's tail [B, K-1, C]");
    require_shape(name.c_str(), inputs, {batch, num_rows, tail_shape[2]}, "[B, M, C]");
    if (require_one_device(name.c_str(), {tail, inputs}) != device) {
      throw std::invalid_argument(name + ": on " + layers[l].tail.device.to_string() + ", layer 0 on " +
                                  device.to_string() + "; one call per device");
    }
  }
  check_counts(op, counts, batch, device);
  if (!device.is_cuda()) {
    for (const ConvTailLayer& layer : layers) {
      cpu::commit_conv_tail(layer.tail.as<float>(), layer.inputs.as<float>(), counts.as<std::int64_t>(), batch,
                            tail_shape[1], num_rows, tail_shape[2]);
    }
    return;
  }
#ifdef ORTSPEC_WITH_CUDA
  std::vector<cuda::ConvTailPointers> pointers;
  for (const ConvTailLayer& layer : layers) pointers.push_back({layer.tail.as<float>(), layer.inputs.as<float>()});
  cuda::commit_conv_tails(pointers.data(), pointers.size(), counts.as<std::int64_t>(), batch, tail_shape[1],
                          num_rows, tail_shape[2], device.index, stream);
#else
  (void)stream;
  unreachable_cuda();
#endif
}

}  // namespace ortspec
