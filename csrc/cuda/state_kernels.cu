// CUDA state kernels: the device twins of core/state_kernels_cpu.cpp.
//
// The row copies (select_slots, gather_rows) are small and launch-bound (B is a
// batch, not a token count), so they favour simple indexing over cleverness: one
// thread per machine word. write_rows moves whole KV-cache rows (millions of
// elements), so it is the one that cares about throughput: one thread per word
// of the new rows, consecutive threads along the contiguous row (coalesced), and
// 32-bit index arithmetic whenever the tensors allow it. All of them are
// asynchronous on the caller's stream and safe to capture in a CUDA graph. An
// out-of-range index cannot throw on the device; it is recorded in
// g_kernel_error (first one wins) and reported by take_kernel_error().
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "cuda/cuda_backend.h"
#include "cuda/kernel_errors.cuh"

namespace ortspec::cuda {
namespace {

enum KernelId : int {
  kNoError = 0,
  kSelectSlots = 1,
  kWriteRowsCount = 4,
  kWriteRowsPosition = 5,
  kGatherRows = 6,
  kAdvanceSpeculative = 7,
};

__device__ KernelErrorRecord g_kernel_error = {kNoError, 0, 0, 0, 0};

__device__ void record_kernel_error(int kernel, long long row, long long value, long long limit,
                                    long long column = 0) {
  record_first_error(g_kernel_error, kernel, row, value, limit, column);
}

constexpr int kThreadsPerBlock = 256;

unsigned int blocks_for(long long work_items) {
  return static_cast<unsigned int>((work_items + kThreadsPerBlock - 1) / kThreadsPerBlock);
}

// Calls launch(Word{}) with the widest Word (16, 8, 4, 2 or 1 bytes) that divides
// row_bytes and every address in `pointers`, so that rows are copied in as few,
// as wide, aligned accesses as possible (bitwise: the dtype does not matter).
template <typename Launch>
void with_widest_word(std::size_t row_bytes, std::initializer_list<const void*> pointers,
                      Launch&& launch) {
  auto fits = [&](std::size_t word) {
    if (row_bytes % word != 0) return false;
    for (const void* pointer : pointers) {
      if (reinterpret_cast<std::uintptr_t>(pointer) % word != 0) return false;
    }
    return true;
  };
  if (fits(16)) {
    launch(uint4{});
  } else if (fits(8)) {
    launch(static_cast<unsigned long long>(0));
  } else if (fits(4)) {
    launch(static_cast<unsigned int>(0));
  } else if (fits(2)) {
    launch(static_cast<unsigned short>(0));
  } else {
    launch(static_cast<unsigned char>(0));
  }
}

// ---- select_slots, gather_rows: one thread per Word of the [B, row] output ---
// out[b] = source row (slot * slot_stride + b * batch_stride), slot = index[b]:
// select_slots reads window [W, B, row] (slot_stride B, batch_stride 1),
// gather_rows reads src [B, M, row] (slot_stride 1, batch_stride M).
template <typename Word>
__global__ void pick_rows_kernel(const Word* source,      // [.., words_per_row]
                                 const long long* index,  // [B]
                                 Word* out,               // [B, words_per_row]
                                 long long num_slots, long long batch, long long words_per_row,
                                 long long slot_stride, long long batch_stride, int kernel) {
  long long item = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (item >= batch * words_per_row) return;
  long long b = item / words_per_row;
  long long word = item % words_per_row;
  long long slot = index[b];
  if (slot < 0 || slot >= num_slots) {
    if (word == 0) record_kernel_error(kernel, b, slot, num_slots);
    return;  // this row of out is left unchanged
  }
  out[item] = source[(slot * slot_stride + b * batch_stride) * words_per_row + word];
}

void launch_pick_rows(const void* source, const std::int64_t* index, void* out,
                      long long num_slots, long long batch, std::size_t row_bytes,
                      long long slot_stride, long long batch_stride, KernelId kernel,
                      cudaStream_t stream) {
  const auto* slot_index = reinterpret_cast<const long long*>(index);
  with_widest_word(row_bytes, {source, out}, [&](auto word_tag) {
    using Word = decltype(word_tag);
    long long words_per_row = static_cast<long long>(row_bytes / sizeof(Word));
    long long work_items = batch * words_per_row;
    if (work_items == 0) return;
    pick_rows_kernel<Word><<<blocks_for(work_items), kThreadsPerBlock, 0, stream>>>(
        static_cast<const Word*>(source), slot_index, static_cast<Word*>(out), num_slots, batch,
        words_per_row, slot_stride, batch_stride, kernel);
  });
}

// ---- write_rows: one thread per Word of rows [B, P, M, words_per_row] --------
// Index is int where every offset fits (the common case: 32-bit division is far
// cheaper than 64-bit on the device), long long otherwise.
template <typename Word, typename Index>
__global__ void write_rows_kernel(Word* cache,                  // [B, P, L, words_per_row]
                                  const Word* rows,             // [B, P, M, words_per_row]
                                  const long long* positions,   // [B, M]
                                  const long long* counts,      // [B] or nullptr (all M)
                                  Index outer, Index cache_length, Index num_rows,
                                  Index words_per_row, long long work_items) {
  long long linear = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (linear >= work_items) return;
  Index item = static_cast<Index>(linear);
  Index word = item % words_per_row;
  Index rest = item / words_per_row;
  Index j = rest % num_rows;
  rest /= num_rows;
  Index p = rest % outer;
  Index b = rest / outer;
  long long count = counts == nullptr ? static_cast<long long>(num_rows) : counts[b];
  if (count < 0 || count > static_cast<long long>(num_rows)) {
    if (j == 0 && p == 0 && word == 0) record_kernel_error(kWriteRowsCount, b, count, num_rows);
    return;  // nothing is written for this request
  }
  if (static_cast<long long>(j) >= count) return;
  long long position = positions[b * num_rows + j];
  if (position < 0 || position >= static_cast<long long>(cache_length)) {
    if (p == 0 && word == 0) {
      record_kernel_error(kWriteRowsPosition, b, position, cache_length, j);
    }
    return;  // this entry is not written
  }
  cache[((b * outer + p) * cache_length + static_cast<Index>(position)) * words_per_row + word] =
      rows[item];
}

template <typename Word>
void launch_write_rows(void* cache, const void* rows, const long long* positions,
                       const long long* counts, long long batch, long long outer,
                       long long cache_length, long long num_rows, std::size_t row_bytes,
                       cudaStream_t stream) {
  long long words_per_row = static_cast<long long>(row_bytes / sizeof(Word));
  long long work_items = batch * outer * num_rows * words_per_row;
  if (work_items == 0) return;
  long long cache_words = batch * outer * cache_length * words_per_row;
  if (work_items <= INT_MAX && cache_words <= INT_MAX) {
    write_rows_kernel<Word, int><<<blocks_for(work_items), kThreadsPerBlock, 0, stream>>>(
        static_cast<Word*>(cache), static_cast<const Word*>(rows), positions, counts,
        static_cast<int>(outer), static_cast<int>(cache_length), static_cast<int>(num_rows),
        static_cast<int>(words_per_row), work_items);
  } else {
    write_rows_kernel<Word, long long><<<blocks_for(work_items), kThreadsPerBlock, 0, stream>>>(
        static_cast<Word*>(cache), static_cast<const Word*>(rows), positions, counts, outer,
        cache_length, num_rows, words_per_row, work_items);
  }
}

// ---- copy_many: blockIdx.y picks the copy, a grid-stride loop over its 16-byte words ----
constexpr int kCopiesPerLaunch = 64;  // 64 x 24 bytes of table: well inside the 4 KiB of kernel parameters
constexpr unsigned int kMaxCopyBlocks = 1024;

struct CopyTable {
  const uint4* src[kCopiesPerLaunch];
  uint4* dst[kCopiesPerLaunch];
  long long words[kCopiesPerLaunch];
};

__global__ void copy_many_kernel(CopyTable table) {
  const int copy = blockIdx.y;
  const uint4* src = table.src[copy];
  uint4* dst = table.dst[copy];
  const long long words = table.words[copy];
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long word = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; word < words;
       word += stride) {
    dst[word] = src[word];
  }
}

// ---- advance_decode_inputs: one thread per batch row ---------------------------
__global__ void advance_decode_inputs_kernel(const long long* tokens, long long* ids, long long* positions,
                                             long long batch, long long last_position) {
  long long b = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (b >= batch) return;
  ids[b] = tokens[b];
  positions[b] = min(positions[b] + 1, last_position);
}

// ---- advance_speculative_inputs: one thread per batch row (k+1 <= a few columns) -------
__global__ void advance_speculative_inputs_kernel(const long long* step_ids, long long* ids, long long* positions,
                                                  long long* verified, long long* counts, long long batch,
                                                  long long k, long long last_start) {
  long long b = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (b >= batch) return;
  const long long* row = step_ids + b * (2 * k + 2);
  long long* ids_row = ids + b * (k + 1);
  long long* positions_row = positions + b * (k + 1);
  long long* verified_row = verified + b * (k + 1);
  const long long accepted = row[k + 1];
  const long long first = positions_row[0];
  for (long long j = 0; j <= k; ++j) verified_row[j] = positions_row[j];
  if (accepted < 0 || accepted > k) {
    record_kernel_error(kAdvanceSpeculative, b, accepted, k + 1, k + 1);
    counts[b] = 0;
    return;
  }
  const long long start = min(first + accepted + 1, last_start);
  counts[b] = accepted + 1;
  ids_row[0] = row[accepted];  // the bonus g_a
  for (long long j = 0; j <= k; ++j) {
    positions_row[j] = start + j;
    if (j < k) ids_row[1 + j] = row[k + 2 + j];  // the head's drafts d_1..d_k
  }
}

std::string describe_kernel_error(const KernelErrorRecord& record) {
  std::string row = std::to_string(record.row);
  std::string value = std::to_string(record.value);
  std::string limit = std::to_string(record.limit);
  switch (record.kernel) {
    case kSelectSlots:
      return "select_slots: index[" + row + "]=" + value + " is out of range for a window of W=" +
             limit + " slots (valid 0.." + std::to_string(record.limit - 1) +
             "); that row of live was left unchanged";
    case kWriteRowsCount:
      return "write_rows: counts[" + row + "]=" + value + " is out of range 0..M=" + limit +
             "; nothing was written for that request";
    case kWriteRowsPosition:
      return "write_rows: positions[" + row + ", " + std::to_string(record.column) + "]=" +
             value + " is out of range for a cache of L=" + limit + " positions (valid 0.." +
             std::to_string(record.limit - 1) + "); that row was not written";
    case kGatherRows:
      return "gather_rows: index[" + row + "]=" + value + " is out of range for src of M=" +
             limit + " rows (valid 0.." + std::to_string(record.limit - 1) +
             "); that row of dst was left unchanged";
    case kAdvanceSpeculative:
      return "advance_speculative_inputs: step_ids[" + row + ", " + std::to_string(record.column) +
             "] (the accept length) = " + value + " is out of range 0..k=" + std::to_string(record.limit - 1) +
             "; that row's next inputs were left unchanged";
    default:
      return "unknown state kernel error " + std::to_string(record.kernel);
  }
}

}  // namespace

void select_slots(const void* window, const std::int64_t* index, void* live,
                  std::int64_t num_slots, std::int64_t batch, std::size_t row_bytes, int device,
                  std::uintptr_t stream) {
  if (batch == 0 || row_bytes == 0) return;
  DeviceGuard guard(device);
  launch_pick_rows(window, index, live, num_slots, batch, row_bytes, /*slot_stride=*/batch,
                   /*batch_stride=*/1, kSelectSlots, as_stream(stream));
  check_launch("select_slots");
}

void gather_rows(const void* src, const std::int64_t* index, void* dst, std::int64_t batch,
                 std::int64_t num_rows, std::size_t row_bytes, int device,
                 std::uintptr_t stream) {
  if (batch == 0 || row_bytes == 0) return;
  DeviceGuard guard(device);
  launch_pick_rows(src, index, dst, num_rows, batch, row_bytes, /*slot_stride=*/1,
                   /*batch_stride=*/num_rows, kGatherRows, as_stream(stream));
  check_launch("gather_rows");
}

void write_rows(void* cache, const void* rows, const std::int64_t* positions,
                const std::int64_t* counts, std::int64_t batch, std::int64_t outer,
                std::int64_t cache_length, std::int64_t num_rows, std::size_t row_bytes,
                int device, std::uintptr_t stream) {
  if (batch == 0 || outer == 0 || num_rows == 0 || row_bytes == 0) return;
  DeviceGuard guard(device);
  const auto* positions_ll = reinterpret_cast<const long long*>(positions);
  const auto* counts_ll = reinterpret_cast<const long long*>(counts);
  cudaStream_t cuda_stream = as_stream(stream);
  with_widest_word(row_bytes, {cache, rows}, [&](auto word_tag) {
    launch_write_rows<decltype(word_tag)>(cache, rows, positions_ll, counts_ll, batch, outer,
                                          cache_length, num_rows, row_bytes, cuda_stream);
  });
  check_launch("write_rows");
}

void advance_decode_inputs(const std::int64_t* tokens, std::int64_t* ids, std::int64_t* positions,
                           std::int64_t batch, std::int64_t last_position, int device,
                           std::uintptr_t stream) {
  if (batch == 0) return;
  DeviceGuard guard(device);
  advance_decode_inputs_kernel<<<blocks_for(batch), kThreadsPerBlock, 0, as_stream(stream)>>>(
      reinterpret_cast<const long long*>(tokens), reinterpret_cast<long long*>(ids),
      reinterpret_cast<long long*>(positions), batch, last_position);
  check_launch("advance_decode_inputs");
}

void advance_speculative_inputs(const std::int64_t* step_ids, std::int64_t* ids, std::int64_t* positions,
                                std::int64_t* verified, std::int64_t* counts, std::int64_t batch,
                                std::int64_t k, std::int64_t last_start, int device, std::uintptr_t stream) {
  if (batch == 0) return;
  DeviceGuard guard(device);
  advance_speculative_inputs_kernel<<<blocks_for(batch), kThreadsPerBlock, 0, as_stream(stream)>>>(
      reinterpret_cast<const long long*>(step_ids), reinterpret_cast<long long*>(ids),
      reinterpret_cast<long long*>(positions), reinterpret_cast<long long*>(verified),
      reinterpret_cast<long long*>(counts), batch, k, last_start);
  check_launch("advance_speculative_inputs");
}

void copy_many(const ByteCopy* copies, std::size_t count, int device, std::uintptr_t stream) {
  if (count == 0) return;
  DeviceGuard guard(device);
  for (std::size_t start = 0; start < count; start += kCopiesPerLaunch) {
    const int n = static_cast<int>(std::min<std::size_t>(kCopiesPerLaunch, count - start));
    CopyTable table{};
    long long most = 0;
    for (int i = 0; i < n; ++i) {
      const ByteCopy& copy = copies[start + i];
      table.src[i] = static_cast<const uint4*>(copy.src);
      table.dst[i] = static_cast<uint4*>(copy.dst);
      table.words[i] = static_cast<long long>(copy.nbytes / sizeof(uint4));
      most = std::max(most, table.words[i]);
    }
    if (most == 0) continue;
    dim3 grid(std::min(blocks_for(most), kMaxCopyBlocks), static_cast<unsigned int>(n));
    copy_many_kernel<<<grid, kThreadsPerBlock, 0, as_stream(stream)>>>(table);
    check_launch("copy_buffers");
  }
}

std::string take_kernel_error(int device, std::uintptr_t stream) {
  DeviceGuard guard(device);
  KernelErrorRecord record = take_error_record(g_kernel_error, as_stream(stream), "state kernel");
  if (record.kernel != kNoError) return describe_kernel_error(record);
  return take_transition_kernel_error(device, stream);
}

}  // namespace ortspec::cuda
