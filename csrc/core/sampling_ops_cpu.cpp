// The CPU reference of core/sampling_ops.h, which the CUDA kernels match bit for bit: every sum is
// of fixed-point integers, every select exact.
#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "core/sampling_ops.h"

namespace ortspec::sampling::cpu {
namespace {

// A row's order keys and fixed-point masses: what both selects read.
struct RowThreshold {
  std::vector<std::uint32_t> keys;
  std::vector<std::uint64_t> masses;

  std::int64_t vocab() const { return static_cast<std::int64_t>(keys.size()); }

  // The K-th largest key, and how many keys are larger.
  std::pair<std::uint32_t, std::int64_t> kth_largest(std::int64_t k) const {
    std::vector<std::uint32_t> sorted = keys;
    std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end(), std::greater<std::uint32_t>());
    const std::uint32_t kth = sorted[static_cast<std::size_t>(k - 1)];
    std::int64_t larger = 0;
    for (const std::uint32_t key : keys) larger += key > kth;
    return {kth, larger};
  }

  // The mass of the K largest: those above t_k, and K - above of t_k's ties (equal z, equal mass).
  std::uint64_t top_mass(std::uint32_t kth, std::int64_t larger, std::int64_t k) const {
    std::uint64_t above = 0, tie = 0;
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (keys[i] > kth) above += masses[i];
      else if (keys[i] == kth) tie = masses[i];
    }
    return above + static_cast<std::uint64_t>(k - larger) * tie;
  }

  // The key whose mass above is < target and with its ties >= target (the smallest key when the
  // mass never reaches it).
  std::uint32_t mass_select(std::uint64_t target) const {
    std::vector<std::pair<std::uint32_t, std::uint64_t>> entries(keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) entries[i] = {keys[i], masses[i]};
    std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    std::uint64_t above = 0;
    for (std::size_t i = 0; i < entries.size();) {
      std::size_t j = i;
      std::uint64_t group = 0;
      for (; j < entries.size() && entries[j].first == entries[i].first; ++j) group += entries[j].second;
      if (above < target && above + group >= target) return entries[i].first;
      above += group;
      i = j;
    }
    return entries.back().first;
  }

  // The smallest key kept by top-k (k <= V), then top-p (p < 1: on); -inf's key when neither cuts.
  std::uint32_t threshold(std::int64_t k, float p) const {
    if (k == vocab() && !(p < 1.0f)) return order_key(float_bits(-std::numeric_limits<float>::infinity()));
    std::uint32_t kept = 0;  // the smallest key: no bound from top-k
    std::uint64_t total = 0;
    if (k < vocab()) {
      const auto [kth, larger] = kth_largest(k);
      kept = kth;
      if (p < 1.0f) total = top_mass(kth, larger, k);
    } else {
      for (const std::uint64_t mass : masses) total += mass;
    }
    if (p < 1.0f) kept = std::max(kept, mass_select(scale_mass(total, p, /*round_up=*/true)));
    return kept;
  }
};

std::int64_t clamp_top_k(std::int64_t top_k, std::int64_t vocab) {
  return top_k > 0 ? std::min(top_k, vocab) : vocab;
}

// The first index whose cumulative mass exceeds u x the total (total > 0).
std::int64_t inverse_cdf(const std::vector<std::uint64_t>& masses, std::uint64_t total, float u) {
  const std::uint64_t target = scale_mass(total, u, /*round_up=*/false);  // < total
  std::uint64_t cumulative = 0;
  const std::int64_t vocab = static_cast<std::int64_t>(masses.size());
  for (std::int64_t i = 0; i < vocab; ++i) {
    cumulative += masses[static_cast<std::size_t>(i)];
    if (cumulative > target) return i;
  }
  return vocab - 1;
}

}  // namespace

void sampling_threshold(const float* z, const float* probs, const std::int64_t* top_k, const float* top_p,
                        float* threshold, std::int64_t rows, std::int64_t rows_per_request, std::int64_t vocab) {
  const int bits = fraction_bits(vocab);
  RowThreshold row{std::vector<std::uint32_t>(static_cast<std::size_t>(vocab)),
                   std::vector<std::uint64_t>(static_cast<std::size_t>(vocab))};
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t request = r / rows_per_request;
    for (std::int64_t i = 0; i < vocab; ++i) {
      row.keys[static_cast<std::size_t>(i)] = order_key(float_bits(z[r * vocab + i]));
      row.masses[static_cast<std::size_t>(i)] = fixed_mass(probs[r * vocab + i], bits);
    }
    threshold[r] = bits_float(key_bits(row.threshold(clamp_top_k(top_k[request], vocab), top_p[request])));
  }
}

void draw(const float* weights, const float* u, std::int64_t* index, std::int64_t rows, std::int64_t vocab) {
  const int bits = fraction_bits(vocab);
  std::vector<std::uint64_t> masses(static_cast<std::size_t>(vocab));
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* w = weights + r * vocab;
    std::uint64_t total = 0;
    for (std::int64_t i = 0; i < vocab; ++i) total += masses[static_cast<std::size_t>(i)] = fixed_mass(w[i], bits);
    if (total == 0) {  // no weight reaches 2^-bits: the largest, else (all zero) V - 1 as the reference
      const std::int64_t largest = std::max_element(w, w + vocab) - w;
      index[r] = w[largest] > 0.0f ? largest : vocab - 1;
      continue;
    }
    index[r] = inverse_cdf(masses, total, u[r]);
  }
}

namespace {

// A row of logits under the sampling transform (core/sampling_ops.h): its kept weights'
// fixed-point masses (0 where not kept) and their total.
struct TransformedRow {
  float top = 0.0f;
  std::uint32_t kept = 0;
  std::uint64_t total = 0;
  RowThreshold row;
  std::vector<float> weight;

  explicit TransformedRow(std::int64_t vocab)
      : row{std::vector<std::uint32_t>(static_cast<std::size_t>(vocab)),
            std::vector<std::uint64_t>(static_cast<std::size_t>(vocab))},
        weight(static_cast<std::size_t>(vocab)) {}

  const std::vector<std::uint64_t>& masses() const { return row.masses; }

  void transform(const float* l, float temperature, std::int64_t top_k, float top_p, float min_p) {
    const std::int64_t vocab = row.vocab();
    const int bits = fraction_bits(vocab);
    const float scale = reciprocal_rn(temperature);
    top = -std::numeric_limits<float>::infinity();
    for (std::int64_t i = 0; i < vocab; ++i) top = std::max(top, mul_rn(l[i], scale));
    for (std::int64_t i = 0; i < vocab; ++i) {
      const auto at = static_cast<std::size_t>(i);
      const float z = mul_rn(l[i], scale);
      weight[at] = exp_rn(sub_rn(z, top));
      row.keys[at] = order_key(float_bits(z));
      row.masses[at] = fixed_mass(weight[at], bits);
    }
    kept = row.threshold(clamp_top_k(top_k, vocab), top_p);
    total = 0;
    for (std::size_t i = 0; i < row.keys.size(); ++i) {
      if (row.keys[i] < kept || (min_p > 0.0f && !(weight[i] >= min_p))) row.masses[i] = 0;
      total += row.masses[i];
    }
  }
};

}  // namespace

void sample_token(const float* logits, const std::int64_t* greedy, const float* temperature, const std::int64_t* top_k,
                  const float* top_p, const float* min_p, const float* u, std::int64_t* token, std::int64_t rows,
                  std::int64_t rows_per_request, std::int64_t vocab) {
  TransformedRow row(vocab);
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t b = r / rows_per_request;
    if (!(temperature[b] > 0.0f)) {
      token[r] = greedy[r];
      continue;
    }
    row.transform(logits + r * vocab, temperature[b], top_k[b], top_p[b], min_p[b]);
    token[r] = row.total > 0 ? inverse_cdf(row.masses(), row.total, u[r]) : greedy[r];  // nothing kept (min_p > 1)
  }
}

void transform_rows(const float* logits, const float* temperature, const std::int64_t* top_k, const float* top_p,
                    const float* min_p, std::int64_t* stats, std::int64_t rows, std::int64_t rows_per_request,
                    std::int64_t vocab) {
  TransformedRow row(vocab);
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t b = r / rows_per_request;
    std::int64_t* out = stats + 3 * r;
    if (!(temperature[b] > 0.0f)) {
      out[0] = out[1] = out[2] = 0;
      continue;
    }
    row.transform(logits + r * vocab, temperature[b], top_k[b], top_p[b], min_p[b]);
    out[0] = float_bits(row.top), out[1] = row.kept, out[2] = static_cast<std::int64_t>(row.total);
  }
}

void speculative_accept(const float* logits, const std::int64_t* stats, const std::int64_t* drafts, const float* q,
                        const float* temperature, const float* min_p, const float* u,
                        const std::int64_t* greedy_accepted, const std::int64_t* greedy_token, std::int64_t* accepted,
                        std::int64_t* emitted, std::int64_t requests, std::int64_t k, std::int64_t vocab) {
  const int bits = fraction_bits(vocab);
  std::vector<std::uint64_t> masses(static_cast<std::size_t>(vocab));
  for (std::int64_t b = 0; b < requests; ++b) {
    if (!(temperature[b] > 0.0f)) {
      accepted[b] = greedy_accepted[b], emitted[b] = greedy_token[b];
      continue;
    }
    const float scale = reciprocal_rn(temperature[b]), floor = min_p[b];
    // the kept mass of row i at token x, from its stats (as the transform made it)
    auto mass = [&](std::int64_t i, std::int64_t x) -> std::uint64_t {
      const std::int64_t* s = stats + 3 * (b * (k + 1) + i);
      const float z = mul_rn(logits[(b * (k + 1) + i) * vocab + x], scale);
      if (order_key(float_bits(z)) < static_cast<std::uint32_t>(s[1])) return 0;
      const float w = exp_rn(sub_rn(z, bits_float(static_cast<std::uint32_t>(s[0]))));
      return floor > 0.0f && !(w >= floor) ? 0 : fixed_mass(w, bits);
    };
    auto total = [&](std::int64_t i) { return static_cast<std::uint64_t>(stats[3 * (b * (k + 1) + i) + 2]); };
    std::int64_t a = 0;
    for (; a < k; ++a) {
      const std::int64_t d = drafts[b * k + a];
      const double p = mass_probability(mass(a, d), total(a));
      if (!(mul_rn_d(u[b * (k + 1) + a], q[(b * k + a) * vocab + d]) < p)) break;
    }
    accepted[b] = a;
    std::uint64_t sum = 0;
    if (a < k) {  // the residual max(0, p_a - q_{a+1})
      const double inverse = inverse_mass(total(a));
      for (std::int64_t x = 0; x < vocab; ++x) {
        sum += masses[static_cast<std::size_t>(x)] = residual_mass(mass(a, x), inverse, q[(b * k + a) * vocab + x], bits);
      }
    }
    if (sum == 0) {  // after k accepts, or p_a == q_{a+1}: from p_a itself
      for (std::int64_t x = 0; x < vocab; ++x) sum += masses[static_cast<std::size_t>(x)] = mass(a, x);
    }
    emitted[b] = sum > 0 ? inverse_cdf(masses, sum, u[b * (k + 1) + k]) : greedy_token[b];  // nothing kept (min_p > 1)
  }
}

}  // namespace ortspec::sampling::cpu
