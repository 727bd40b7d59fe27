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

struct RowThreshold {
  const float* z;
  const float* probs;
  std::int64_t vocab;
  int bits;

  std::uint32_t key(std::int64_t i) const { return order_key(float_bits(z[i])); }

  // The K-th largest key, and how many keys are larger.
  std::pair<std::uint32_t, std::int64_t> kth_largest(std::int64_t k) const {
    std::vector<std::uint32_t> keys(static_cast<std::size_t>(vocab));
    for (std::int64_t i = 0; i < vocab; ++i) keys[static_cast<std::size_t>(i)] = key(i);
    std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), std::greater<std::uint32_t>());
    const std::uint32_t kth = keys[static_cast<std::size_t>(k - 1)];
    std::int64_t larger = 0;
    for (std::int64_t i = 0; i < vocab; ++i) larger += key(i) > kth;
    return {kth, larger};
  }

  // The mass of the K largest: those above t_k, and K - above of t_k's ties (equal z, equal probs).
  std::uint64_t top_mass(std::uint32_t kth, std::int64_t larger, std::int64_t k) const {
    std::uint64_t above = 0, tie = 0;
    for (std::int64_t i = 0; i < vocab; ++i) {
      const std::uint32_t ki = key(i);
      if (ki > kth) above += fixed_mass(probs[i], bits);
      else if (ki == kth) tie = fixed_mass(probs[i], bits);
    }
    return above + static_cast<std::uint64_t>(k - larger) * tie;
  }

  // The key whose mass above is < target and with its ties >= target (the smallest key when the
  // mass never reaches it).
  std::uint32_t mass_select(std::uint64_t target) const {
    std::vector<std::pair<std::uint32_t, std::uint64_t>> entries(static_cast<std::size_t>(vocab));
    for (std::int64_t i = 0; i < vocab; ++i) entries[static_cast<std::size_t>(i)] = {key(i), fixed_mass(probs[i], bits)};
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
};

}  // namespace

void sampling_threshold(const float* z, const float* probs, const std::int64_t* top_k, const float* top_p,
                        float* threshold, std::int64_t rows, std::int64_t rows_per_request, std::int64_t vocab) {
  const int bits = fraction_bits(vocab);
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t request = r / rows_per_request;
    const RowThreshold row{z + r * vocab, probs + r * vocab, vocab, bits};
    const std::int64_t k = top_k[request] > 0 ? std::min(top_k[request], vocab) : vocab;
    const float p = top_p[request];
    if (k == vocab && !(p < 1.0f)) {
      threshold[r] = -std::numeric_limits<float>::infinity();  // keeps every token
      continue;
    }
    std::uint32_t kept = 0;  // the smallest key: no bound from top-k
    std::uint64_t total = 0;
    if (k < vocab) {
      const auto [kth, larger] = row.kth_largest(k);
      kept = kth;
      if (p < 1.0f) total = row.top_mass(kth, larger, k);
    } else {
      for (std::int64_t i = 0; i < vocab; ++i) total += fixed_mass(row.probs[i], bits);
    }
    if (p < 1.0f) kept = std::max(kept, row.mass_select(scale_mass(total, p, /*round_up=*/true)));
    threshold[r] = bits_float(key_bits(kept));
  }
}

void draw(const float* weights, const float* u, std::int64_t* index, std::int64_t rows, std::int64_t vocab) {
  const int bits = fraction_bits(vocab);
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* w = weights + r * vocab;
    std::uint64_t total = 0;
    for (std::int64_t i = 0; i < vocab; ++i) total += fixed_mass(w[i], bits);
    if (total == 0) {  // no weight reaches 2^-bits: the largest, else (all zero) V - 1 as the reference
      const std::int64_t largest = std::max_element(w, w + vocab) - w;
      index[r] = w[largest] > 0.0f ? largest : vocab - 1;
      continue;
    }
    const std::uint64_t target = scale_mass(total, u[r], /*round_up=*/false);  // < total
    std::uint64_t cumulative = 0;
    std::int64_t i = 0;
    for (; i < vocab; ++i) {
      cumulative += fixed_mass(w[i], bits);
      if (cumulative > target) break;
    }
    index[r] = std::min(i, vocab - 1);
  }
}

}  // namespace ortspec::sampling::cpu
