// CUDA state kernels: the device twins of core/state_kernels_cpu.cpp.
//
// Each kernel is small and launch-bound (B is a batch, not a token count), so
// they favour simple indexing over cleverness: one thread per batch row for the
// per-request bookkeeping, one thread per machine word for select_slots. All of
// them are asynchronous on the caller's stream and safe to capture in a CUDA
// graph. An out-of-range index cannot throw on the device; it is recorded in
// g_kernel_error (first one wins) and reported by take_kernel_error().
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda/cuda_backend.h"

namespace ortspec::cuda {
namespace {

enum KernelId : int { kNoError = 0, kSelectSlots = 1, kAdvancePositions = 2, kGatherTokens = 3 };

struct KernelErrorRecord {
  int kernel;          // KernelId of the first failing kernel; kNoError when clear
  long long row;       // batch row b
  long long value;     // the bad index / accepted length
  long long limit;     // W for select_slots, k for gather_accepted_tokens
};

__device__ KernelErrorRecord g_kernel_error = {kNoError, 0, 0, 0};

__device__ void record_kernel_error(int kernel, long long row, long long value, long long limit) {
  if (atomicCAS(&g_kernel_error.kernel, kNoError, kernel) == kNoError) {
    g_kernel_error.row = row;
    g_kernel_error.value = value;
    g_kernel_error.limit = limit;
  }
}

constexpr int kThreadsPerBlock = 256;

unsigned int blocks_for(long long work_items) {
  return static_cast<unsigned int>((work_items + kThreadsPerBlock - 1) / kThreadsPerBlock);
}

cudaStream_t as_stream(std::uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

void check_launch(const char* kernel) {
  cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(kernel) + " launch failed: " +
                             cudaGetErrorString(status));
  }
}

// ---- accept_lengths: one thread per row -------------------------------------
__global__ void accept_lengths_kernel(const long long* drafts,   // [B, k]
                                      const long long* targets,  // [B, k+1]
                                      long long* accepted,       // [B]
                                      long long batch, long long num_drafts) {
  long long b = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (b >= batch) return;
  long long length = 0;
  while (length < num_drafts &&
         drafts[b * num_drafts + length] == targets[b * (num_drafts + 1) + length]) {
    ++length;
  }
  accepted[b] = length;
}

// ---- select_slots: one thread per Word of the [B, row] live tensor ----------
template <typename Word>
__global__ void select_slots_kernel(const Word* window,  // [W, B, words_per_row]
                                    const long long* index,  // [B]
                                    Word* live,              // [B, words_per_row]
                                    long long num_slots, long long batch,
                                    long long words_per_row) {
  long long item = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (item >= batch * words_per_row) return;
  long long b = item / words_per_row;
  long long word = item % words_per_row;
  long long slot = index[b];
  if (slot < 0 || slot >= num_slots) {
    if (word == 0) record_kernel_error(kSelectSlots, b, slot, num_slots);
    return;  // this row of live is left unchanged
  }
  live[item] = window[(slot * batch + b) * words_per_row + word];
}

template <typename Word>
void launch_select_slots(const void* window, const long long* index, void* live,
                         long long num_slots, long long batch, std::size_t row_bytes,
                         cudaStream_t stream) {
  long long words_per_row = static_cast<long long>(row_bytes / sizeof(Word));
  long long work_items = batch * words_per_row;
  if (work_items == 0) return;
  select_slots_kernel<Word><<<blocks_for(work_items), kThreadsPerBlock, 0, stream>>>(
      static_cast<const Word*>(window), index, static_cast<Word*>(live), num_slots, batch,
      words_per_row);
}

// ---- advance_positions: one thread per row ----------------------------------
template <typename Position, typename SeqLen>
__global__ void advance_positions_kernel(Position* positions,  // [B]
                                         SeqLen* seq_lens,     // [B]
                                         const long long* accepted,  // [B]
                                         long long batch) {
  long long b = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (b >= batch) return;
  if (accepted[b] < 0) {
    record_kernel_error(kAdvancePositions, b, accepted[b], 0);
    return;  // this row is left unchanged
  }
  long long emitted = accepted[b] + 1;  // accepted drafts + the bonus token
  positions[b] = static_cast<Position>(positions[b] + emitted);
  seq_lens[b] = static_cast<SeqLen>(seq_lens[b] + emitted);
}

template <typename Position>
void launch_advance_positions(Position* positions, void* seq_lens, DType seq_lens_dtype,
                              const long long* accepted, long long batch, cudaStream_t stream) {
  if (seq_lens_dtype == DType::kInt32) {
    advance_positions_kernel<<<blocks_for(batch), kThreadsPerBlock, 0, stream>>>(
        positions, static_cast<int*>(seq_lens), accepted, batch);
  } else {
    advance_positions_kernel<<<blocks_for(batch), kThreadsPerBlock, 0, stream>>>(
        positions, static_cast<long long*>(seq_lens), accepted, batch);
  }
}

// ---- gather_accepted_tokens: one thread per row -----------------------------
__global__ void gather_accepted_tokens_kernel(const long long* drafts,    // [B, k]
                                              const long long* targets,   // [B, k+1]
                                              const long long* accepted,  // [B]
                                              long long* out,             // [B, k+1]
                                              long long batch, long long num_drafts) {
  long long b = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (b >= batch) return;
  long long length = accepted[b];
  long long* out_row = out + b * (num_drafts + 1);
  if (length < 0 || length > num_drafts) {
    record_kernel_error(kGatherTokens, b, length, num_drafts);
    for (long long i = 0; i <= num_drafts; ++i) out_row[i] = -1;
    return;
  }
  for (long long i = 0; i < length; ++i) out_row[i] = drafts[b * num_drafts + i];
  out_row[length] = targets[b * (num_drafts + 1) + length];
  for (long long i = length + 1; i <= num_drafts; ++i) out_row[i] = -1;
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
    case kAdvancePositions:
      return "advance_positions: accepted[" + row + "]=" + value +
             " is negative; that row was left unchanged";
    case kGatherTokens:
      return "gather_accepted_tokens: accepted[" + row + "]=" + value +
             " is out of range 0..k=" + limit + "; that row of out was filled with -1";
    default:
      return "unknown state kernel error " + std::to_string(record.kernel);
  }
}

}  // namespace

void accept_lengths(const std::int64_t* drafts, const std::int64_t* targets,
                    std::int64_t* accepted, std::int64_t batch, std::int64_t num_drafts,
                    int device, std::uintptr_t stream) {
  if (batch == 0) return;
  DeviceGuard guard(device);
  accept_lengths_kernel<<<blocks_for(batch), kThreadsPerBlock, 0, as_stream(stream)>>>(
      reinterpret_cast<const long long*>(drafts), reinterpret_cast<const long long*>(targets),
      reinterpret_cast<long long*>(accepted), batch, num_drafts);
  check_launch("accept_lengths");
}

void select_slots(const void* window, const std::int64_t* index, void* live,
                  std::int64_t num_slots, std::int64_t batch, std::size_t row_bytes, int device,
                  std::uintptr_t stream) {
  if (batch == 0 || row_bytes == 0) return;
  DeviceGuard guard(device);
  // Copy in the widest word that divides the row and both base addresses.
  auto fits = [&](std::size_t word) {
    return row_bytes % word == 0 && reinterpret_cast<std::uintptr_t>(window) % word == 0 &&
           reinterpret_cast<std::uintptr_t>(live) % word == 0;
  };
  const auto* slot_index = reinterpret_cast<const long long*>(index);
  cudaStream_t cuda_stream = as_stream(stream);
  if (fits(16)) {
    launch_select_slots<uint4>(window, slot_index, live, num_slots, batch, row_bytes, cuda_stream);
  } else if (fits(8)) {
    launch_select_slots<unsigned long long>(window, slot_index, live, num_slots, batch, row_bytes,
                                            cuda_stream);
  } else if (fits(4)) {
    launch_select_slots<unsigned int>(window, slot_index, live, num_slots, batch, row_bytes,
                                      cuda_stream);
  } else if (fits(2)) {
    launch_select_slots<unsigned short>(window, slot_index, live, num_slots, batch, row_bytes,
                                        cuda_stream);
  } else {
    launch_select_slots<unsigned char>(window, slot_index, live, num_slots, batch, row_bytes,
                                       cuda_stream);
  }
  check_launch("select_slots");
}

void advance_positions(void* positions, DType positions_dtype, void* seq_lens,
                       DType seq_lens_dtype, const std::int64_t* accepted, std::int64_t batch,
                       int device, std::uintptr_t stream) {
  if (batch == 0) return;
  DeviceGuard guard(device);
  const auto* accepted_ll = reinterpret_cast<const long long*>(accepted);
  if (positions_dtype == DType::kInt32) {
    launch_advance_positions(static_cast<int*>(positions), seq_lens, seq_lens_dtype, accepted_ll,
                             batch, as_stream(stream));
  } else {
    launch_advance_positions(static_cast<long long*>(positions), seq_lens, seq_lens_dtype,
                             accepted_ll, batch, as_stream(stream));
  }
  check_launch("advance_positions");
}

void gather_accepted_tokens(const std::int64_t* drafts, const std::int64_t* targets,
                            const std::int64_t* accepted, std::int64_t* out,
                            std::int64_t batch, std::int64_t num_drafts, int device,
                            std::uintptr_t stream) {
  if (batch == 0) return;
  DeviceGuard guard(device);
  gather_accepted_tokens_kernel<<<blocks_for(batch), kThreadsPerBlock, 0, as_stream(stream)>>>(
      reinterpret_cast<const long long*>(drafts), reinterpret_cast<const long long*>(targets),
      reinterpret_cast<const long long*>(accepted), reinterpret_cast<long long*>(out), batch,
      num_drafts);
  check_launch("gather_accepted_tokens");
}

std::string take_kernel_error(int device, std::uintptr_t stream) {
  DeviceGuard guard(device);
  cudaStream_t cuda_stream = as_stream(stream);
  KernelErrorRecord record{};
  cudaError_t status = cudaMemcpyFromSymbolAsync(&record, g_kernel_error, sizeof(record), 0,
                                                 cudaMemcpyDeviceToHost, cuda_stream);
  if (status == cudaSuccess) status = cudaStreamSynchronize(cuda_stream);
  if (status != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(std::string("reading the state kernel error record failed: ") +
                             cudaGetErrorString(status));
  }
  if (record.kernel == kNoError) return "";
  KernelErrorRecord cleared = {kNoError, 0, 0, 0};
  status = cudaMemcpyToSymbolAsync(g_kernel_error, &cleared, sizeof(cleared), 0,
                                   cudaMemcpyHostToDevice, cuda_stream);
  if (status == cudaSuccess) status = cudaStreamSynchronize(cuda_stream);
  if (status != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(std::string("clearing the state kernel error record failed: ") +
                             cudaGetErrorString(status));
  }
  return describe_kernel_error(record);
}

}  // namespace ortspec::cuda
