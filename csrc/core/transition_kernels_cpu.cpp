// CPU reference implementations of the transition commit (transition_kernels.h): plain loops in
// float32, written to be obviously right. They are the oracle for the CUDA kernels.
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/transition_kernels.h"

namespace ortspec::cpu {
namespace {

void check_counts(const char* op, const std::int64_t* counts, std::int64_t batch, std::int64_t num_rows) {
  for (std::int64_t b = 0; b < batch; ++b) {  // every request before any write
    if (counts[b] < 0 || counts[b] > num_rows) {
      throw std::invalid_argument(std::string(op) + ": counts[" + std::to_string(b) + "]=" +
                                  std::to_string(counts[b]) + " is out of range 0..M=" +
                                  std::to_string(num_rows) + " (the verify's rows); nothing was written");
    }
  }
}

// One row's transition of one head's S [dk, dv]: S ← e·S; u = β (v − Sᵀk); S ← S + k uᵀ.
void apply_row(float* S, const float* k, const float* v, float e, float beta, std::int64_t key_dim,
               std::int64_t value_dim, std::vector<float>& u) {
  for (std::int64_t i = 0; i < key_dim * value_dim; ++i) S[i] *= e;
  for (std::int64_t c = 0; c < value_dim; ++c) {
    float retrieved = 0.0f;  // (Sᵀk)[c]
    for (std::int64_t i = 0; i < key_dim; ++i) retrieved += S[i * value_dim + c] * k[i];
    u[c] = beta * (v[c] - retrieved);
  }
  for (std::int64_t i = 0; i < key_dim; ++i) {
    for (std::int64_t c = 0; c < value_dim; ++c) S[i * value_dim + c] += k[i] * u[c];
  }
}

}  // namespace

void replay_transitions(float* state,                // [B, nv, dk, dv]
                        const float* keys,           // [B, M, nk, dk]
                        const float* values,         // [B, M, nv, dv]
                        const float* decay,          // [B, M, nv]
                        const float* beta,           // [B, M, nv]
                        const std::int64_t* counts,  // [B]
                        const TransitionShape& s) {
  check_counts("replay_transitions", counts, s.batch, s.rows);
  const std::int64_t group = s.value_heads / s.key_heads;  // value heads per key head
  const std::int64_t head_size = s.key_dim * s.value_dim;
  std::vector<float> u(static_cast<std::size_t>(s.value_dim));
  for (std::int64_t b = 0; b < s.batch; ++b) {
    for (std::int64_t h = 0; h < s.value_heads; ++h) {
      float* S = state + (b * s.value_heads + h) * head_size;
      for (std::int64_t j = 0; j < counts[b]; ++j) {
        const std::int64_t row = b * s.rows + j;
        const float* k = keys + (row * s.key_heads + h / group) * s.key_dim;
        const float* v = values + (row * s.value_heads + h) * s.value_dim;
        const float e = std::exp(decay[row * s.value_heads + h]);
        apply_row(S, k, v, e, beta[row * s.value_heads + h], s.key_dim, s.value_dim, u);
      }
    }
  }
}

void commit_conv_tail(float* tail,                 // [B, K-1, C]
                      const float* inputs,         // [B, M, C]
                      const std::int64_t* counts,  // [B]
                      std::int64_t batch, std::int64_t tail_rows, std::int64_t num_rows,
                      std::int64_t channels) {
  check_counts("commit_conv_tails", counts, batch, num_rows);
  for (std::int64_t b = 0; b < batch; ++b) {
    float* own = tail + b * tail_rows * channels;
    const float* fed = inputs + b * num_rows * channels;
    for (std::int64_t t = 0; t < tail_rows; ++t) {  // in order: row t reads row n + t >= t, not yet written
      const std::int64_t source = counts[b] + t;   // in concat(tail, inputs)
      const float* from = source < tail_rows ? own + source * channels : fed + (source - tail_rows) * channels;
      if (from != own + t * channels) {
        for (std::int64_t c = 0; c < channels; ++c) own[t * channels + c] = from[c];
      }
    }
  }
}

}  // namespace ortspec::cpu
