// CPU reference implementations of the state kernels: plain loops, written to
// be obviously right. They are the oracle for the CUDA kernels and the fast
// path of CPU sessions (B is small, so nothing here needs to be clever).
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "core/state_kernels.h"

namespace ortspec::cpu {

void select_slots(const void* window,         // [W, B, row_bytes]
                  const std::int64_t* index,  // [B]
                  void* live,                 // [B, row_bytes]
                  std::int64_t num_slots, std::int64_t batch, std::size_t row_bytes) {
  for (std::int64_t b = 0; b < batch; ++b) {  // check every row before writing any
    if (index[b] < 0 || index[b] >= num_slots) {
      throw std::invalid_argument("select_slots: index[" + std::to_string(b) + "]=" +
                                  std::to_string(index[b]) +
                                  " is out of range for a window of W=" +
                                  std::to_string(num_slots) + " slots (valid 0.." +
                                  std::to_string(num_slots - 1) + ")");
    }
  }
  const char* window_bytes = static_cast<const char*>(window);
  char* live_bytes = static_cast<char*>(live);
  for (std::int64_t b = 0; b < batch; ++b) {
    const char* source = window_bytes + (index[b] * batch + b) * row_bytes;
    std::memcpy(live_bytes + b * row_bytes, source, row_bytes);
  }
}

void write_rows(void* cache,                    // [B, P, L, row_bytes]
                const void* rows,               // [B, P, M, row_bytes]
                const std::int64_t* positions,  // [B, M]
                const std::int64_t* counts,     // [B], or nullptr for all M rows
                std::int64_t batch, std::int64_t outer, std::int64_t cache_length,
                std::int64_t num_rows, std::size_t row_bytes) {
  for (std::int64_t b = 0; b < batch; ++b) {  // check every entry before writing any
    std::int64_t count = counts == nullptr ? num_rows : counts[b];
    if (count < 0 || count > num_rows) {
      throw std::invalid_argument("write_rows: counts[" + std::to_string(b) + "]=" +
                                  std::to_string(count) + " is out of range 0..M=" +
                                  std::to_string(num_rows));
    }
    for (std::int64_t j = 0; j < count; ++j) {
      std::int64_t position = positions[b * num_rows + j];
      if (position < 0 || position >= cache_length) {
        throw std::invalid_argument("write_rows: positions[" + std::to_string(b) + ", " +
                                    std::to_string(j) + "]=" + std::to_string(position) +
                                    " is out of range for a cache of L=" +
                                    std::to_string(cache_length) + " positions (valid 0.." +
                                    std::to_string(cache_length - 1) + ")");
      }
    }
  }
  char* cache_bytes = static_cast<char*>(cache);
  const char* rows_bytes = static_cast<const char*>(rows);
  for (std::int64_t b = 0; b < batch; ++b) {
    std::int64_t count = counts == nullptr ? num_rows : counts[b];
    for (std::int64_t p = 0; p < outer; ++p) {
      std::int64_t plane = b * outer + p;  // one [L, row] plane of cache, [M, row] of rows
      for (std::int64_t j = 0; j < count; ++j) {
        std::int64_t position = positions[b * num_rows + j];
        std::memcpy(cache_bytes + (plane * cache_length + position) * row_bytes,
                    rows_bytes + (plane * num_rows + j) * row_bytes, row_bytes);
      }
    }
  }
}

void gather_rows(const void* src,            // [B, M, row_bytes]
                 const std::int64_t* index,  // [B]
                 void* dst,                  // [B, row_bytes]
                 std::int64_t batch, std::int64_t num_rows, std::size_t row_bytes) {
  for (std::int64_t b = 0; b < batch; ++b) {  // check every row before writing any
    if (index[b] < 0 || index[b] >= num_rows) {
      throw std::invalid_argument("gather_rows: index[" + std::to_string(b) + "]=" +
                                  std::to_string(index[b]) + " is out of range for src of M=" +
                                  std::to_string(num_rows) + " rows (valid 0.." +
                                  std::to_string(num_rows - 1) + ")");
    }
  }
  const char* src_bytes = static_cast<const char*>(src);
  char* dst_bytes = static_cast<char*>(dst);
  for (std::int64_t b = 0; b < batch; ++b) {
    std::memcpy(dst_bytes + b * row_bytes, src_bytes + (b * num_rows + index[b]) * row_bytes,
                row_bytes);
  }
}

void advance_decode_inputs(const std::int64_t* tokens,  // [B]
                           std::int64_t* ids,            // [B]
                           std::int64_t* positions,      // [B]
                           std::int64_t batch, std::int64_t last_position) {
  for (std::int64_t b = 0; b < batch; ++b) {
    ids[b] = tokens[b];
    positions[b] = std::min(positions[b] + 1, last_position);
  }
}

void advance_speculative_inputs(const std::int64_t* step_ids,  // [B, 2k+2]: g_0..g_k | a | d_1..d_k
                                std::int64_t* ids,              // [B, k+1]
                                std::int64_t* positions,        // [B, k+1]
                                std::int64_t* verified,         // [B, k+1]
                                std::int64_t* counts,           // [B]
                                std::int64_t batch, std::int64_t k, std::int64_t last_start) {
  const std::int64_t width = 2 * k + 2;
  for (std::int64_t b = 0; b < batch; ++b) {  // check every row before writing any
    const std::int64_t accepted = step_ids[b * width + k + 1];
    if (accepted < 0 || accepted > k) {
      throw std::invalid_argument("advance_speculative_inputs: step_ids[" + std::to_string(b) + ", " +
                                  std::to_string(k + 1) + "] (the accept length) = " +
                                  std::to_string(accepted) + " is out of range 0..k=" + std::to_string(k) +
                                  "; nothing was written");
    }
  }
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t* row = step_ids + b * width;
    const std::int64_t accepted = row[k + 1];
    const std::int64_t start = std::min(positions[b * (k + 1)] + accepted + 1, last_start);
    counts[b] = accepted + 1;
    ids[b * (k + 1)] = row[accepted];  // the bonus g_a
    for (std::int64_t j = 0; j <= k; ++j) {
      verified[b * (k + 1) + j] = positions[b * (k + 1) + j];
      positions[b * (k + 1) + j] = start + j;
      if (j < k) ids[b * (k + 1) + 1 + j] = row[k + 2 + j];  // the head's drafts d_1..d_k
    }
  }
}

}  // namespace ortspec::cpu
