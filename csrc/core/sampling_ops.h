// The steps of a sampled token that ONNX ops cannot do in one kernel per row: the top-k / top-p
// threshold (ONNX Runtime sorts all V for it, row by row), the inverse-CDF draw (a cumulative sum
// over all V), and the whole choice of a sampled decode in one op. The sampling graphs for CUDA
// call them as the custom ops ai.ortspec.SamplingThreshold, ai.ortspec.Draw and
// ai.ortspec.SampleToken (core/ort_custom_ops.cpp); converter/sampling_graph.py says where they sit.
//
// Shapes (R rows = B requests x N rows each, V the vocabulary):
//   sampling_threshold  z f32[R, V] (logits / T), probs f32[R, V] (Softmax(z), each <= 1),
//                       top_k int64[B] (0: off), top_p f32[B] (>= 1: off) -> threshold f32[R]:
//                       the smallest z kept by top-k, then top-p (speculative.sampling.transform:
//                       kept while the mass before a rank is < top_p, ties with the last kept
//                       value kept), read from the sorted values without sorting them.
//   draw                weights f32[R, V] in [0, 1], u f32[R] in [0, 1) -> index int64[R]:
//                       the first index whose cumulative weight exceeds u x the row's total
//                       (speculative.sampling.draw); a row of zero weights gives V - 1.
//   sample_token        logits f32[R, V], greedy int64[R] (the argmax), temperature, top_k,
//                       top_p, min_p [B], u f32[R] -> token int64[R]: greedy where temperature
//                       <= 0, else the draw from the transformed distribution, each step of it
//                       over weights computed in the op from the logits alone: z = logits x
//                       (1 / T), w = exp(max(z - max z, -64)) (exp_rn: the same bits on the CPU
//                       and CUDA), the top-k / top-p threshold over w's masses, min-p as w >=
//                       min_p (p >= min_p x max p), the draw over the kept w.
//   transform_rows      logits f32[R, V], temperature, top_k, top_p, min_p [B] -> stats int64[R, 3]:
//                       each row's transform as sample_token makes it (top z's bits, the kept
//                       key, the kept weights' fixed-point total S; zeros on greedy rows).
//   speculative_accept  logits f32[B, k+1, V], stats int64[B, k+1, 3] (transform_rows'), drafts
//                       int64[B, k], q f32[B, k, V] (what draft i was drawn from), temperature,
//                       min_p [B], u f32[B, k+1], greedy_accepted, greedy_token int64[B] ->
//                       accepted, emitted int64[B]: exact speculative sampling (speculative.
//                       sampling.speculative_accept) with p_i = m_i / S_i, accepting d_{i+1} while
//                       u_i q_{i+1}(d) < p_i(d), then a draw with u_k from max(0, p_a - q_{a+1})
//                       (from p_a where that is empty or a = k); greedy rows get the greedy rule's.
//
// Masses are sums of fixed-point integers (each weight truncated to a multiple of 2^-F with
// F = 61 - ceil(log2 V): 2^-43 at V = 248,320), so a sum does not depend on its order: the CPU
// and CUDA ops give the same bits for the same inputs, run after run, and a seeded request's
// tokens do not move with the GPU's scheduling. A weight below 2^-F counts as 0 (a token that
// unlikely is never drawn; the graphs' float32 sums lose more than that at V = 248,320).
//
// The threshold in value terms (the numpy reference says it by ranks): with K = min(top_k, V)
// (V when off), t_k is the K-th largest z and total the mass of the K largest; with P = top_p x
// total, t_p is the z whose mass above it is < P and with its ties >= P; threshold = max(t_k,
// t_p), t_k alone when top_p >= 1, and -inf (every token) when neither truncates. Keys are z's
// bits made order-preserving as unsigned integers: both selects are radix selects over 32 bits
// on CUDA, plain selects here.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define ORTSPEC_HOST_DEVICE __host__ __device__
#else
#define ORTSPEC_HOST_DEVICE
#endif

namespace ortspec::sampling {

// 61 - ceil(log2 V): the fixed-point fraction bits, so V weights of at most 1 sum below 2^61.
ORTSPEC_HOST_DEVICE inline int fraction_bits(std::int64_t vocab) {
  int log2_ceil = 0;
  while ((std::int64_t{1} << log2_ceil) < vocab) ++log2_ceil;
  return 61 - log2_ceil;
}

// A weight in [0, 1] as a fixed-point integer (NaN and negatives count 0, above 1 counts 1):
// weight x 2^bits is exact in double, the cast truncates.
ORTSPEC_HOST_DEVICE inline std::uint64_t fixed_mass(float weight, int bits) {
  if (!(weight > 0.0f)) return 0;
  if (weight >= 1.0f) return std::uint64_t{1} << bits;
  return static_cast<std::uint64_t>(static_cast<double>(weight) * static_cast<double>(std::uint64_t{1} << bits));
}

ORTSPEC_HOST_DEVICE inline std::uint32_t float_bits(float value) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(value);
#else
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
#endif
}

ORTSPEC_HOST_DEVICE inline float bits_float(std::uint32_t bits) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
#endif
}

// fraction x total rounded down (up: ceil) exactly, for fraction in [0, 1) and total < 2^62: the
// draw's target (floor(u x total)) and top-p's (ceil(top_p x total)). fraction = m 2^-s with m
// an integer of at most 24 bits, so the product is m x total (< 2^86, two 64-bit words) over 2^s.
ORTSPEC_HOST_DEVICE inline std::uint64_t scale_mass(std::uint64_t total, float fraction, bool round_up) {
  if (!(fraction > 0.0f)) return 0;
  if (fraction >= 1.0f) return total;
  const std::uint32_t bits = float_bits(fraction);
  const int exponent = static_cast<int>((bits >> 23) & 0xFF);
  const std::uint64_t m = exponent ? ((bits & 0x7FFFFFu) | 0x800000u) : (bits & 0x7FFFFFu);
  const int shift = exponent ? 150 - exponent : 149;  // fraction = m x 2^-shift
  const std::uint64_t a = m * (total >> 32), b = m * (total & 0xFFFFFFFFu);  // m x total = a 2^32 + b
  std::uint64_t low = (a << 32) + b;
  const std::uint64_t high = (a >> 32) + (low < b ? 1 : 0);
  std::uint64_t result;
  bool remainder;
  if (shift >= 128) {
    result = 0, remainder = (high | low) != 0;
  } else if (shift >= 64) {
    const int s = shift - 64;
    result = s ? high >> s : high;
    remainder = low != 0 || (s && (high & ((std::uint64_t{1} << s) - 1)) != 0);
  } else {
    result = shift ? (low >> shift) | (high << (64 - shift)) : low;
    remainder = shift && (low & ((std::uint64_t{1} << shift) - 1)) != 0;
  }
  return result + (round_up && remainder ? 1 : 0);
}

// z's bits as an unsigned key ordered as the floats are (-inf lowest), and back.
ORTSPEC_HOST_DEVICE inline std::uint32_t order_key(std::uint32_t bits) {
  return bits ^ ((bits >> 31) ? 0xFFFFFFFFu : 0x80000000u);
}
ORTSPEC_HOST_DEVICE inline std::uint32_t key_bits(std::uint32_t key) {
  return key ^ ((key >> 31) ? 0x80000000u : 0xFFFFFFFFu);
}

// Round-to-nearest float arithmetic that no compiler contracts or reorders: each step of exp_rn is
// one correctly rounded operation, so the CPU and CUDA give the same bits.
ORTSPEC_HOST_DEVICE inline float fma_rn(float a, float b, float c) {
#ifdef __CUDA_ARCH__
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
ORTSPEC_HOST_DEVICE inline float mul_rn(float a, float b) { return fma_rn(a, b, -0.0f); }
ORTSPEC_HOST_DEVICE inline float sub_rn(float a, float b) { return fma_rn(b, -1.0f, a); }
ORTSPEC_HOST_DEVICE inline float reciprocal_rn(float a) {
#ifdef __CUDA_ARCH__
  return __frcp_rn(a);
#else
  return 1.0f / a;
#endif
}

constexpr float kExpFloor = -64.0f;  // z - max z below this counts as this (sampling_graph.EXP_FLOOR)

// e^x for x in [kExpFloor, 0] (clamped there; NaN counts as kExpFloor), within ~2 ulp: x = n ln 2
// + r with |r| <= ln 2 / 2 (ln 2 in two parts), e^r by a degree-6 polynomial (Cephes' expf), then
// 2^n exactly.
ORTSPEC_HOST_DEVICE inline float exp_rn(float x) {
  x = x > 0.0f ? 0.0f : x;
  if (!(x >= kExpFloor)) x = kExpFloor;
#ifdef __CUDA_ARCH__
  const float n = rintf(mul_rn(x, 1.44269504088896341f));
#else
  const float n = std::nearbyint(mul_rn(x, 1.44269504088896341f));
#endif
  float r = fma_rn(n, -0.693359375f, x);
  r = fma_rn(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = fma_rn(p, r, 1.3981999507e-3f);
  p = fma_rn(p, r, 8.3334519073e-3f);
  p = fma_rn(p, r, 4.1665795894e-2f);
  p = fma_rn(p, r, 1.6666665459e-1f);
  p = fma_rn(p, r, 5.0000001201e-1f);
  const float y = fma_rn(fma_rn(p, mul_rn(r, r), r), 1.0f, 1.0f);  // 1 + r + p r^2
  // 2^n by the exponent field (n in [-93, 0]: e^x >= e^-64 is normal, 2^n too)
  return mul_rn(y, bits_float(static_cast<std::uint32_t>(static_cast<int>(n) + 127) << 23));
}

// Speculative sampling's exact arithmetic over a row's fixed-point masses m (of total S): p =
// m / S, the residual max(0, p - q) as one fma, each a correctly rounded double operation.
ORTSPEC_HOST_DEVICE inline double to_double(std::uint64_t m) {
#ifdef __CUDA_ARCH__
  return __ull2double_rn(m);
#else
  return static_cast<double>(m);
#endif
}
ORTSPEC_HOST_DEVICE inline double mass_probability(std::uint64_t m, std::uint64_t total) {
#ifdef __CUDA_ARCH__
  return total ? __ddiv_rn(to_double(m), to_double(total)) : 0.0;
#else
  return total ? to_double(m) / to_double(total) : 0.0;
#endif
}
// u x q, exact in double (two 24-bit significands).
ORTSPEC_HOST_DEVICE inline double mul_rn_d(float u, float q) { return static_cast<double>(u) * static_cast<double>(q); }
ORTSPEC_HOST_DEVICE inline double inverse_mass(std::uint64_t total) {
#ifdef __CUDA_ARCH__
  return __drcp_rn(to_double(total));
#else
  return 1.0 / to_double(total);
#endif
}
// fixed_mass(max(0, m x inverse - q)).
ORTSPEC_HOST_DEVICE inline std::uint64_t residual_mass(std::uint64_t m, double inverse, float q, int bits) {
#ifdef __CUDA_ARCH__
  const double r = __fma_rn(to_double(m), inverse, -static_cast<double>(q));
#else
  const double r = std::fma(to_double(m), inverse, -static_cast<double>(q));
#endif
  if (!(r > 0.0)) return 0;
  if (r >= 1.0) return std::uint64_t{1} << bits;
  return static_cast<std::uint64_t>(r * static_cast<double>(std::uint64_t{1} << bits));
}

namespace cpu {

// The reference the CUDA ops follow (module comment); rows_per_request = N.
void sampling_threshold(const float* z, const float* probs, const std::int64_t* top_k, const float* top_p,
                        float* threshold, std::int64_t rows, std::int64_t rows_per_request, std::int64_t vocab);
void draw(const float* weights, const float* u, std::int64_t* index, std::int64_t rows, std::int64_t vocab);
void sample_token(const float* logits, const std::int64_t* greedy, const float* temperature, const std::int64_t* top_k,
                  const float* top_p, const float* min_p, const float* u, std::int64_t* token, std::int64_t rows,
                  std::int64_t rows_per_request, std::int64_t vocab);
void transform_rows(const float* logits, const float* temperature, const std::int64_t* top_k, const float* top_p,
                    const float* min_p, std::int64_t* stats, std::int64_t rows, std::int64_t rows_per_request,
                    std::int64_t vocab);
void speculative_accept(const float* logits, const std::int64_t* stats, const std::int64_t* drafts, const float* q,
                        const float* temperature, const float* min_p, const float* u,
                        const std::int64_t* greedy_accepted, const std::int64_t* greedy_token, std::int64_t* accepted,
                        std::int64_t* emitted, std::int64_t requests, std::int64_t k, std::int64_t vocab);

}  // namespace cpu
}  // namespace ortspec::sampling
