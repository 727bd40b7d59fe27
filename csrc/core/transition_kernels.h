// The commit of a transition-record verify (convert gdn_verify="transition"). Instead of the
// GDN state after every verify row ([M, B, nv, dk, dv] per layer: 2 MiB per request and row at
// Qwen3.5 sizes), such a verify keeps the small per-row vectors the recurrence consumed, and the
// commit replays the accepted rows onto the pre-verify state, in place, in one launch for all
// layers of a device.
//
// Shapes (B requests, M verify rows, nk key heads, nv = r·nk value heads, K the conv kernel):
//   replay_transitions  per layer: state f32[B, nv, dk, dv] (in place), keys f32[B, M, nk, dk]
//                       (k̂: L2-normalised), values f32[B, M, nv·dv] (or [B, M, nv, dv]),
//                       decay f32[B, M, nv] (g, log space), beta f32[B, M, nv]; counts int64[B]
//                       in 0..M, one for all layers. For b, h < nv, j < counts[b], with
//                       S = state[b, h], k = keys[b, j, ⌊h / r⌋], v = values[b, j, h],
//                       e = exp(decay[b, j, h]), β = beta[b, j, h]:
//                           S ← e·S;   u = β (v − Sᵀk);   S ← S + k uᵀ
//                       (LinearAttention's gated_delta rule row by row: after it, S is the
//                       state after row counts[b] - 1, what a plain decode of those rows keeps)
//   commit_conv_tails   per layer: tail f32[B, K-1, C] (in place), inputs f32[B, M, C] (the rows'
//                       pre-conv q, k, v); counts as above, n = counts[b]:
//                           tail[b] ← rows n .. n+K-2 of concat(tail[b], inputs[b])   [K-1+M, C]
//                       (the last K-1 pre-conv inputs up to row n-1, what CausalConvWithState keeps)
//
// Every layer of one call has the same shapes and device (one model's GDN layers on one GPU).
// The checks are those of state_kernels.h (DTypeError / std::invalid_argument naming the function,
// the layer and the argument); a count outside 0..M throws on the CPU before anything is written,
// and on CUDA leaves that request's state as it was and is reported by take_kernel_error(). The
// CUDA kernels compute in float32 like the CPU reference but are not bitwise equal to it (the
// device's expf and the order of the Sᵀk sums differ): the native tests compare within 1e-5.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/tensor_ref.h"

namespace ortspec {

// One GDN layer's recurrent state and its verify rows' record (module comment).
struct TransitionLayer {
  TensorRef state;
  TensorRef keys;
  TensorRef values;
  TensorRef decay;
  TensorRef beta;
};

// One GDN layer's conv tail and its verify rows' pre-conv inputs.
struct ConvTailLayer {
  TensorRef tail;
  TensorRef inputs;
};

void replay_transitions(const std::vector<TransitionLayer>& layers, const TensorRef& counts,
                        std::uintptr_t stream = 0);
void commit_conv_tails(const std::vector<ConvTailLayer>& layers, const TensorRef& counts,
                       std::uintptr_t stream = 0);

// The dimensions of a replay_transitions call (every layer alike).
struct TransitionShape {
  std::int64_t batch, rows, key_heads, value_heads, key_dim, value_dim;
};

// The largest dk the CUDA kernel holds per thread (Qwen3.5: 128); the CPU takes any.
constexpr std::int64_t kMaxCudaTransitionKeyDim = 256;

namespace cpu {

// One layer, validated and contiguous: state [B, nv, dk, dv], keys [B, M, nk, dk], values
// [B, M, nv, dv], decay and beta [B, M, nv], counts [B] (checked here: throws before writing).
void replay_transitions(float* state, const float* keys, const float* values, const float* decay,
                        const float* beta, const std::int64_t* counts, const TransitionShape& shape);
// One layer: tail [B, K-1, C], inputs [B, M, C], counts [B] (checked here).
void commit_conv_tail(float* tail, const float* inputs, const std::int64_t* counts, std::int64_t batch,
                      std::int64_t tail_rows, std::int64_t num_rows, std::int64_t channels);

}  // namespace cpu
}  // namespace ortspec
