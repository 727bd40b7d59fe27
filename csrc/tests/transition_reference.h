// Random transition records (a GDN verify's per-row vectors) and a float64 reference of their
// commit, shared by the CPU and CUDA suites. Written from the gated delta rule itself (whole-matrix
// steps in double, vectors and index arithmetic), independently of core/transition_kernels_cpu.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/transition_kernels.h"
#include "tests/reference.h"

namespace ortspec_test {

struct TransitionCase {
  ortspec::TransitionShape shape;  // batch, rows M, key heads nk, value heads nv, dk, dv
  std::vector<float> state, keys, values, decay, beta;  // [B,nv,dk,dv], [B,M,nk,dk], [B,M,nv,dv], [B,M,nv] x 2
  Tokens counts;  // [B] in 0..M

  ortspec::Shape state_shape() const { return {shape.batch, shape.value_heads, shape.key_dim, shape.value_dim}; }
  ortspec::Shape keys_shape() const { return {shape.batch, shape.rows, shape.key_heads, shape.key_dim}; }
  ortspec::Shape values_shape() const { return {shape.batch, shape.rows, shape.value_heads * shape.value_dim}; }
  ortspec::Shape gate_shape() const { return {shape.batch, shape.rows, shape.value_heads}; }
};

// Keys of unit length (as LinearAttention expects), decay in (-2, 0], beta in (0, 1); counts: the
// first request takes every row, the second none, the rest at random.
inline TransitionCase make_transition_case(ortspec::TransitionShape shape, std::mt19937_64& rng) {
  const auto& s = shape;
  TransitionCase c{shape, random_floats(s.batch * s.value_heads * s.key_dim * s.value_dim, rng),
                   random_floats(s.batch * s.rows * s.key_heads * s.key_dim, rng),
                   random_floats(s.batch * s.rows * s.value_heads * s.value_dim, rng), {}, {}, {}};
  for (std::size_t head = 0; head * s.key_dim < c.keys.size(); ++head) {
    double norm = 0.0;
    for (std::int64_t i = 0; i < s.key_dim; ++i) norm += double(c.keys[head * s.key_dim + i]) * c.keys[head * s.key_dim + i];
    for (std::int64_t i = 0; i < s.key_dim; ++i) c.keys[head * s.key_dim + i] /= static_cast<float>(std::sqrt(norm));
  }
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (std::int64_t i = 0; i < s.batch * s.rows * s.value_heads; ++i) {
    c.decay.push_back(-2.0f * unit(rng));
    c.beta.push_back(0.01f + 0.98f * unit(rng));
  }
  std::uniform_int_distribution<std::int64_t> pick(0, s.rows);
  for (std::int64_t b = 0; b < s.batch; ++b) c.counts.push_back(b == 0 ? s.rows : b == 1 ? 0 : pick(rng));
  return c;
}

// The state after each request's counts[b] rows, in double: per head, with K = k kᵀ,
// S ← e (I − β K) S + β k vᵀ (the gated delta rule with u = β (v − e Sᵀk) expanded).
inline std::vector<double> reference_replay(const TransitionCase& c) {
  const auto& s = c.shape;
  std::vector<double> state(c.state.begin(), c.state.end());
  const std::int64_t group = s.value_heads / s.key_heads;
  for (std::int64_t b = 0; b < s.batch; ++b) {
    for (std::int64_t h = 0; h < s.value_heads; ++h) {
      double* S = state.data() + (b * s.value_heads + h) * s.key_dim * s.value_dim;
      for (std::int64_t j = 0; j < c.counts[b]; ++j) {
        const std::int64_t row = b * s.rows + j;
        const float* k = c.keys.data() + (row * s.key_heads + h / group) * s.key_dim;
        const float* v = c.values.data() + (row * s.value_heads + h) * s.value_dim;
        const double e = std::exp(double(c.decay[row * s.value_heads + h])), beta = c.beta[row * s.value_heads + h];
        std::vector<double> k_dot_s(s.value_dim, 0.0);  // (kᵀS)[c]
        for (std::int64_t i = 0; i < s.key_dim; ++i) {
          for (std::int64_t col = 0; col < s.value_dim; ++col) k_dot_s[col] += k[i] * S[i * s.value_dim + col];
        }
        for (std::int64_t i = 0; i < s.key_dim; ++i) {
          for (std::int64_t col = 0; col < s.value_dim; ++col) {
            double& x = S[i * s.value_dim + col];
            x = e * (x - beta * k[i] * k_dot_s[col]) + beta * k[i] * v[col];
          }
        }
      }
    }
  }
  return state;
}

// tail [B, K-1, C] after each request's counts[b] rows of inputs [B, M, C]: rows n..n+K-2 of the
// concatenation, gathered element by element.
inline std::vector<float> reference_conv_tail(const std::vector<float>& tail, const std::vector<float>& inputs,
                                              const Tokens& counts, std::int64_t tail_rows, std::int64_t num_rows,
                                              std::int64_t channels) {
  std::vector<float> out(tail.size());
  for (std::size_t b = 0; b < counts.size(); ++b) {
    for (std::int64_t t = 0; t < tail_rows; ++t) {
      const std::int64_t source = counts[b] + t;
      for (std::int64_t col = 0; col < channels; ++col) {
        out.at(flat_offset({std::int64_t(b), t, col}, {std::int64_t(counts.size()), tail_rows, channels})) =
            source < tail_rows ? tail.at(flat_offset({std::int64_t(b), source, col}, {std::int64_t(counts.size()), tail_rows, channels}))
                               : inputs.at(flat_offset({std::int64_t(b), source - tail_rows, col},
                                                       {std::int64_t(counts.size()), num_rows, channels}));
      }
    }
  }
  return out;
}

// max |got − want| / (1 + max |want|): the tolerance measure of the GPU state checks.
inline double relative_error(const std::vector<float>& got, const std::vector<double>& want) {
  double worst = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, std::abs(double(got.at(i)) - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return worst / (1.0 + scale);
}

}  // namespace ortspec_test
