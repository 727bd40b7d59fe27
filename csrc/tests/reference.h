// Straightforward references for the state kernels and random inputs for them,
// shared by the CPU and CUDA suites. Written independently of
// core/state_kernels_cpu.cpp (vectors and index arithmetic, no pointers), so a
// bug there does not hide by being copied here.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace ortspec_test {

using Tokens = std::vector<std::int64_t>;

// A speculative step's tokens: targets [B, k+1] random; drafts [B, k] agree
// with targets on a random prefix (so every accept length 0..k occurs), then
// differ.
struct StepTokens {
  std::int64_t batch = 0, num_drafts = 0;
  Tokens drafts, targets;
};

inline StepTokens random_step_tokens(std::int64_t batch, std::int64_t num_drafts,
                                     std::mt19937_64& rng) {
  StepTokens step{batch, num_drafts, Tokens(batch * num_drafts), Tokens(batch * (num_drafts + 1))};
  std::uniform_int_distribution<std::int64_t> token(0, 50000);
  std::uniform_int_distribution<std::int64_t> agree(0, num_drafts);
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t i = 0; i <= num_drafts; ++i) step.targets[b * (num_drafts + 1) + i] = token(rng);
    std::int64_t agreeing = agree(rng);
    for (std::int64_t i = 0; i < num_drafts; ++i) {
      std::int64_t target = step.targets[b * (num_drafts + 1) + i];
      step.drafts[b * num_drafts + i] = i < agreeing ? target : target + 1 + token(rng) % 7;
    }
    // Later agreement after the first mismatch must not count.
    if (agreeing + 1 < num_drafts) {
      step.drafts[b * num_drafts + agreeing + 1] = step.targets[b * (num_drafts + 1) + agreeing + 1];
    }
  }
  return step;
}

inline Tokens reference_accept_lengths(const StepTokens& step) {
  Tokens accepted(step.batch, 0);
  for (std::int64_t b = 0; b < step.batch; ++b) {
    for (std::int64_t i = 0; i < step.num_drafts; ++i) {
      if (step.drafts.at(b * step.num_drafts + i) != step.targets.at(b * (step.num_drafts + 1) + i)) break;
      accepted[b] = i + 1;
    }
  }
  return accepted;
}

inline Tokens reference_gather(const StepTokens& step, const Tokens& accepted) {
  Tokens out;
  for (std::int64_t b = 0; b < step.batch; ++b) {
    Tokens row;
    for (std::int64_t i = 0; i < accepted[b]; ++i) row.push_back(step.drafts.at(b * step.num_drafts + i));
    row.push_back(step.targets.at(b * (step.num_drafts + 1) + accepted[b]));
    while (static_cast<std::int64_t>(row.size()) < step.num_drafts + 1) row.push_back(-1);
    out.insert(out.end(), row.begin(), row.end());
  }
  return out;
}

// window [W, B, N] -> live [B, N]
template <typename T>
std::vector<T> reference_select(const std::vector<T>& window, const Tokens& index,
                                std::int64_t batch, std::int64_t features) {
  std::vector<T> live(batch * features);
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t n = 0; n < features; ++n) {
      live[b * features + n] = window.at((index[b] * batch + b) * features + n);
    }
  }
  return live;
}

inline std::vector<float> random_floats(std::size_t count, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(count);
  for (float& value : values) value = normal(rng);
  return values;
}

inline Tokens random_indices(std::int64_t count, std::int64_t limit, std::mt19937_64& rng) {
  std::uniform_int_distribution<std::int64_t> pick(0, limit - 1);
  Tokens values(count);
  for (std::int64_t& value : values) value = pick(rng);
  return values;
}

}  // namespace ortspec_test
