// CUDA transition commit: the device twins of core/transition_kernels_cpu.cpp.
//
// replay_transitions is bandwidth-bound: it reads and writes each request's state once (B·nv
// heads of dk×dv float32, 64 KiB per head at Qwen3.5 sizes) and its rows' small vectors. The
// columns of a head's S are independent (u[c] needs column c of S, k and v[c] only), so a block
// owns 32 columns of one (request, value head): a warp's 32 lanes take consecutive columns
// (coalesced rows of S), 8 warps split the dk rows, each thread keeps its dk/8 elements of its
// column in registers for every replayed row, and S is read from and written back to global
// memory once. Per replayed row: k in shared memory, the Sᵀk partial sums of the 8 warps added in
// shared memory, u broadcast back. Grid: (dv/32 column tiles, nv heads, B·layers), every GDN
// layer of the call in the same launch (a table of layer pointers in the kernel parameters);
// at Qwen3.5-0.8B, batch 1: 4 × 16 × 18 blocks.
//
// commit_conv_tails moves K-1 rows of C floats per request: one thread per (request, channel),
// consecutive threads along the channels; blockIdx.y picks the layer.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "cuda/cuda_backend.h"
#include "cuda/kernel_errors.cuh"

namespace ortspec::cuda {
namespace {

enum TransitionKernelId : int { kNoError = 0, kReplayTransitions = 1, kCommitConvTails = 2 };

__device__ KernelErrorRecord g_transition_error = {kNoError, 0, 0, 0, 0};

constexpr int kColumns = 32;  // threadIdx.x: value columns of a block
constexpr int kSlices = 8;    // threadIdx.y: the dk rows, interleaved (row i is slice i % 8)
constexpr int kMaxRowsPerThread = static_cast<int>(kMaxCudaTransitionKeyDim) / kSlices;
constexpr int kLayersPerLaunch = 32;  // 32 x 40 bytes of pointers: well inside the kernel parameters
constexpr int kThreadsPerBlock = 256;

struct ReplayTable {
  TransitionPointers layers[kLayersPerLaunch];
};

struct ConvTable {
  ConvTailPointers layers[kLayersPerLaunch];
};

// RowsPerThread: the dk/8 rows of S a thread keeps (a template argument, so the registers are
// sized for the model: 16 at dk = 128, not the 32 dk = 256 needs).
template <int RowsPerThread>
__global__ void replay_transitions_kernel(ReplayTable table, const long long* counts, int batch, int rows,
                                          int key_heads, int value_heads, int key_dim, int value_dim) {
  const TransitionPointers layer = table.layers[blockIdx.z / batch];
  const int b = static_cast<int>(blockIdx.z % batch), h = static_cast<int>(blockIdx.y);
  const int column = static_cast<int>(blockIdx.x) * kColumns + static_cast<int>(threadIdx.x);
  const bool active = column < value_dim;
  const long long count = counts[b];
  if (count < 0 || count > rows) {
    if (threadIdx.x == 0 && threadIdx.y == 0 && blockIdx.x == 0 && h == 0) {
      record_first_error(g_transition_error, kReplayTransitions, b, count, rows);
    }
    return;  // this request's state is left as it was
  }
  __shared__ float key[kMaxCudaTransitionKeyDim];
  __shared__ float partial[kSlices][kColumns];
  __shared__ float update[kColumns];
  float* S = layer.state + (static_cast<long long>(b) * value_heads + h) * key_dim * value_dim;
  float s[RowsPerThread];  // column `column` of S, rows threadIdx.y + kSlices * r
#pragma unroll
  for (int r = 0; r < RowsPerThread; ++r) {
    const int i = static_cast<int>(threadIdx.y) + kSlices * r;
    s[r] = active && i < key_dim ? S[static_cast<long long>(i) * value_dim + column] : 0.0f;
  }
  const int thread = static_cast<int>(threadIdx.y) * kColumns + static_cast<int>(threadIdx.x);
  const int key_head = h / (value_heads / key_heads);
  for (long long j = 0; j < count; ++j) {
    const long long row = static_cast<long long>(b) * rows + j;
    const float* k = layer.keys + (row * key_heads + key_head) * key_dim;
    for (int i = thread; i < key_dim; i += kColumns * kSlices) key[i] = k[i];
    const float e = expf(layer.decay[row * value_heads + h]);
    const float beta = layer.beta[row * value_heads + h];
    __syncthreads();
    float retrieved = 0.0f;  // this thread's share of (e S)ᵀk at its column
#pragma unroll
    for (int r = 0; r < RowsPerThread; ++r) {
      const int i = static_cast<int>(threadIdx.y) + kSlices * r;
      if (i < key_dim) {
        s[r] *= e;
        retrieved += s[r] * key[i];
      }
    }
    partial[threadIdx.y][threadIdx.x] = retrieved;
    __syncthreads();
    if (threadIdx.y == 0) {
      float total = 0.0f;
      for (int y = 0; y < kSlices; ++y) total += partial[y][threadIdx.x];
      update[threadIdx.x] = active ? beta * (layer.values[(row * value_heads + h) * value_dim + column] - total) : 0.0f;
    }
    __syncthreads();
    const float u = update[threadIdx.x];
#pragma unroll
    for (int r = 0; r < RowsPerThread; ++r) {
      const int i = static_cast<int>(threadIdx.y) + kSlices * r;
      if (i < key_dim) s[r] += key[i] * u;
    }
    __syncthreads();  // key, partial and update are rewritten by the next row
  }
  if (count == 0 || !active) return;
#pragma unroll
  for (int r = 0; r < RowsPerThread; ++r) {
    const int i = static_cast<int>(threadIdx.y) + kSlices * r;
    if (i < key_dim) S[static_cast<long long>(i) * value_dim + column] = s[r];
  }
}

__global__ void commit_conv_tails_kernel(ConvTable table, const long long* counts, long long batch, int tail_rows,
                                         int rows, long long channels) {
  const long long item = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (item >= batch * channels) return;
  const long long b = item / channels, c = item % channels;
  const long long count = counts[b];
  if (count < 0 || count > rows) {
    if (c == 0 && blockIdx.y == 0) record_first_error(g_transition_error, kCommitConvTails, b, count, rows);
    return;  // this request's tail is left as it was
  }
  const ConvTailPointers layer = table.layers[blockIdx.y];
  float* own = layer.tail + b * tail_rows * channels;
  const float* fed = layer.inputs + b * rows * channels;
  for (int t = 0; t < tail_rows; ++t) {  // in order: row t reads row count + t >= t, not yet written
    const long long source = count + t;
    own[t * channels + c] = source < tail_rows ? own[source * channels + c] : fed[(source - tail_rows) * channels + c];
  }
}

std::string describe_transition_error(const KernelErrorRecord& record) {
  const char* op = record.kernel == kReplayTransitions ? "replay_transitions" : "commit_conv_tails";
  const char* kept = record.kernel == kReplayTransitions ? "state" : "conv tail";
  return std::string(op) + ": counts[" + std::to_string(record.row) + "]=" + std::to_string(record.value) +
         " is out of range 0..M=" + std::to_string(record.limit) + " (the verify's rows); that request's " + kept +
         " was left unchanged";
}

}  // namespace

void replay_transitions(const TransitionPointers* layers, std::size_t count, const std::int64_t* counts,
                        const TransitionShape& shape, int device, std::uintptr_t stream) {
  if (count == 0 || shape.batch == 0 || shape.value_heads == 0 || shape.value_dim == 0) return;
  DeviceGuard guard(device);
  const long long per_launch = std::min<long long>(kLayersPerLaunch, std::max<long long>(1, 65535 / shape.batch));
  const dim3 block(kColumns, kSlices);
  for (std::size_t start = 0; start < count; start += static_cast<std::size_t>(per_launch)) {
    const int n = static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(per_launch), count - start));
    ReplayTable table{};
    std::copy(layers + start, layers + start + n, table.layers);
    const dim3 grid(static_cast<unsigned int>((shape.value_dim + kColumns - 1) / kColumns),
                    static_cast<unsigned int>(shape.value_heads), static_cast<unsigned int>(shape.batch * n));
    auto launch = [&](auto kernel) {
      kernel<<<grid, block, 0, as_stream(stream)>>>(
          table, reinterpret_cast<const long long*>(counts), static_cast<int>(shape.batch),
          static_cast<int>(shape.rows), static_cast<int>(shape.key_heads), static_cast<int>(shape.value_heads),
          static_cast<int>(shape.key_dim), static_cast<int>(shape.value_dim));
    };
    const std::int64_t rows_per_thread = (shape.key_dim + kSlices - 1) / kSlices;
    if (rows_per_thread <= 4) {
      launch(replay_transitions_kernel<4>);
    } else if (rows_per_thread <= 8) {
      launch(replay_transitions_kernel<8>);
    } else if (rows_per_thread <= 16) {
      launch(replay_transitions_kernel<16>);
    } else {
      launch(replay_transitions_kernel<kMaxRowsPerThread>);
    }
    check_launch("replay_transitions");
  }
}

void commit_conv_tails(const ConvTailPointers* layers, std::size_t count, const std::int64_t* counts,
                       std::int64_t batch, std::int64_t tail_rows, std::int64_t num_rows, std::int64_t channels,
                       int device, std::uintptr_t stream) {
  const long long items = batch * channels;
  if (count == 0 || items == 0 || tail_rows == 0) return;
  DeviceGuard guard(device);
  for (std::size_t start = 0; start < count; start += kLayersPerLaunch) {
    const int n = static_cast<int>(std::min<std::size_t>(kLayersPerLaunch, count - start));
    ConvTable table{};
    std::copy(layers + start, layers + start + n, table.layers);
    const dim3 grid(static_cast<unsigned int>((items + kThreadsPerBlock - 1) / kThreadsPerBlock),
                    static_cast<unsigned int>(n));
    commit_conv_tails_kernel<<<grid, kThreadsPerBlock, 0, as_stream(stream)>>>(
        table, reinterpret_cast<const long long*>(counts), batch, static_cast<int>(tail_rows),
        static_cast<int>(num_rows), channels);
    check_launch("commit_conv_tails");
  }
}

std::string take_transition_kernel_error(int device, std::uintptr_t stream) {
  DeviceGuard guard(device);
  KernelErrorRecord record = take_error_record(g_transition_error, as_stream(stream), "transition kernel");
  return record.kernel == kNoError ? "" : describe_transition_error(record);
}

}  // namespace ortspec::cuda
