// The CUDA side of ortspec._native, declared in plain C++.
//
// Everything that touches the CUDA runtime lives in the .cu files of this
// directory and is compiled by nvcc; the rest of the extension (arena, kernel
// dispatch, Python bindings) is compiled by the host compiler, includes only
// this header, and calls it only under #ifdef ORTSPEC_WITH_CUDA. That keeps the
// CPU-only build free of CUDA headers and lets one source tree build either way.
//
// Streams are cudaStream_t handles passed as integers (0 = the legacy default
// stream), so that the caller can share one stream with ONNX Runtime's
// `user_compute_stream`. All work is enqueued on that stream; nothing here
// synchronizes unless its name says so.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "core/transition_kernels.h"

namespace ortspec::cuda {

// ---- devices (cuda_runtime.cu) ----------------------------------------------

// Number of usable CUDA devices; 0 when there is no GPU or no driver. Never throws.
int device_count() noexcept;

// Why device_count() is 0 ("" when it is not), e.g. "CUDA driver version is insufficient".
std::string no_device_reason();

// CUDA runtime / driver versions as 1000*major + 10*minor; 0 when unknown.
// compiled_runtime_version() is the toolkit this module was built with.
int compiled_runtime_version() noexcept;
int runtime_version() noexcept;
int driver_version() noexcept;

// Makes `device` current for its lifetime and restores the previous one after.
// Throws std::runtime_error when there is no such device (no GPU, no driver,
// ordinal out of range), with the reason and what to do.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_device_ = -1;
};

// ---- memory (cuda_runtime.cu) -----------------------------------------------

// cudaMalloc of nbytes on `device`, zero-filled and synchronized before return.
void* allocate(std::size_t nbytes, int device);
// cudaFree; never throws (called from destructors).
void release(void* pointer, int device) noexcept;

enum class CopyKind { kHostToDevice, kDeviceToHost, kDeviceToDevice };
void copy_async(void* dst, const void* src, std::size_t nbytes, CopyKind kind, int device,
                std::uintptr_t stream);
// Device to device across GPUs (pipeline stages on different devices), on the destination
// device's `stream`; peer access is enabled on first use where the pair supports it.
void copy_peer_async(void* dst, int dst_device, const void* src, int src_device,
                     std::size_t nbytes, std::uintptr_t stream);
void fill_zero_async(void* dst, std::size_t nbytes, int device, std::uintptr_t stream);
void synchronize(int device, std::uintptr_t stream);

// ---- streams, events, page-locked host memory (cuda_runtime.cu) ------------
// What lets the host run ahead of the GPU (core/streams.h says how they are used).

// A new stream on `device` created with cudaStreamNonBlocking: it never waits for the
// legacy default stream, and CUDA graphs may be captured on it.
std::uintptr_t create_stream(int device);
void destroy_stream(std::uintptr_t stream, int device) noexcept;
// Whether every piece of work enqueued on `stream` so far has finished (cudaStreamQuery);
// never blocks.
bool stream_idle(std::uintptr_t stream, int device);

// An event without timing data (the cheapest kind to record and wait for).
std::uintptr_t create_event(int device);
void destroy_event(std::uintptr_t event, int device) noexcept;
void record_event(std::uintptr_t event, std::uintptr_t stream, int device);
// Whether the work before the event's last record has finished; never blocks.
bool event_done(std::uintptr_t event, int device);
// Blocks until the work before the event's last record has finished.
void synchronize_event(std::uintptr_t event, int device);

// Page-locked host memory (cudaMallocHost), zero-filled: device-to-host copies into it are
// truly asynchronous. release_pinned never throws.
void* allocate_pinned(std::size_t nbytes);
void release_pinned(void* pointer) noexcept;

// ---- state kernels (state_kernels.cu) ---------------------------------------
// Same semantics as the CPU reference in core/state_kernels_cpu.cpp. Kernels
// cannot throw: an invalid index is recorded on the device (first one wins), the
// offending row is handled as documented in core/state_kernels.h, and
// take_kernel_error() reports it at the caller's next sync point.

// live[b, :] = window[index[b], b, :], rows of row_bytes bytes, copied bitwise.
void select_slots(const void* window, const std::int64_t* index, void* live,
                  std::int64_t num_slots, std::int64_t batch, std::size_t row_bytes, int device,
                  std::uintptr_t stream);

// cache [B, P, L, row] <- rows [B, P, M, row]: cache[b, p, positions[b, j]] = rows[b, p, j]
// for j < counts[b] (counts nullptr: all M). Rows of row_bytes bytes, copied bitwise.
// A bad count skips its request, a bad position its entry; both are recorded.
void write_rows(void* cache, const void* rows, const std::int64_t* positions,
                const std::int64_t* counts, std::int64_t batch, std::int64_t outer,
                std::int64_t cache_length, std::int64_t num_rows, std::size_t row_bytes,
                int device, std::uintptr_t stream);

// dst[b, :] = src[b, index[b], :], rows of row_bytes bytes, copied bitwise.
void gather_rows(const void* src, const std::int64_t* index, void* dst, std::int64_t batch,
                 std::int64_t num_rows, std::size_t row_bytes, int device,
                 std::uintptr_t stream);

// ids[b] = tokens[b]; positions[b] = min(positions[b] + 1, last_position); all [B].
void advance_decode_inputs(const std::int64_t* tokens, std::int64_t* ids, std::int64_t* positions,
                           std::int64_t batch, std::int64_t last_position, int device,
                           std::uintptr_t stream);

// core/state_kernels.h's advance_speculative_inputs, one thread per batch row; an accept length
// outside 0..k is recorded (that row: ids and positions unchanged, count 0).
void advance_speculative_inputs(const std::int64_t* step_ids, std::int64_t* ids, std::int64_t* positions,
                                std::int64_t* verified, std::int64_t* counts, std::int64_t batch,
                                std::int64_t k, std::int64_t last_start, int device, std::uintptr_t stream);

// One byte copy of copy_many: dst, src and nbytes all multiples of 16 bytes.
struct ByteCopy {
  void* dst;
  const void* src;
  std::size_t nbytes;
};

// Every copy, in one kernel launch per 64 copies (a step commits every GDN state at once, and
// a launch per state was a measurable share of a pipelined step). Copies must not overlap.
void copy_many(const ByteCopy* copies, std::size_t count, int device, std::uintptr_t stream);

// ---- transition commit (transition_kernels.cu) --------------------------------
// core/transition_kernels.h's replay_transitions and commit_conv_tails, every layer of the call in
// one launch (a table of layers per launch). A count outside 0..M is recorded (that request's
// state and tail unchanged) and reported by take_kernel_error().

struct TransitionPointers {
  float* state;         // [B, nv, dk, dv]
  const float* keys;    // [B, M, nk, dk]
  const float* values;  // [B, M, nv, dv]
  const float* decay;   // [B, M, nv]
  const float* beta;    // [B, M, nv]
};

struct ConvTailPointers {
  float* tail;          // [B, K-1, C]
  const float* inputs;  // [B, M, C]
};

void replay_transitions(const TransitionPointers* layers, std::size_t count, const std::int64_t* counts,
                        const TransitionShape& shape, int device, std::uintptr_t stream);
void commit_conv_tails(const ConvTailPointers* layers, std::size_t count, const std::int64_t* counts,
                       std::int64_t batch, std::int64_t tail_rows, std::int64_t num_rows, std::int64_t channels,
                       int device, std::uintptr_t stream);

// The first count error the transition kernels recorded on `device` since the last call ("" when
// none), then cleared; take_kernel_error() reports it too. Synchronizes `stream`.
std::string take_transition_kernel_error(int device, std::uintptr_t stream);

// ---- sampling ops (sampling_ops.cu) -------------------------------------------
// core/sampling_ops.h's ops, bit for bit the CPU reference's;
// a block or a cluster of blocks per row, enqueued on `stream` (ONNX Runtime's compute stream inside a custom op).

void sampling_threshold(const float* z, const float* probs, const std::int64_t* top_k, const float* top_p,
                        float* threshold, std::int64_t rows, std::int64_t rows_per_request, std::int64_t vocab,
                        std::uintptr_t stream);
void draw(const float* weights, const float* u, std::int64_t* index, std::int64_t rows, std::int64_t vocab,
          std::uintptr_t stream);
void sample_token(const float* logits, const std::int64_t* greedy, const float* temperature, const std::int64_t* top_k,
                  const float* top_p, const float* min_p, const float* u, std::int64_t* token, std::int64_t rows,
                  std::int64_t rows_per_request, std::int64_t vocab, std::uintptr_t stream);
void transform_rows(const float* logits, const float* temperature, const std::int64_t* top_k, const float* top_p,
                    const float* min_p, std::int64_t* stats, std::int64_t rows, std::int64_t rows_per_request,
                    std::int64_t vocab, std::uintptr_t stream);
void speculative_accept(const float* logits, const std::int64_t* stats, const std::int64_t* drafts, const float* q,
                        const float* temperature, const float* min_p, const float* u,
                        const std::int64_t* greedy_accepted, const std::int64_t* greedy_token, std::int64_t* accepted,
                        std::int64_t* emitted, std::int64_t requests, std::int64_t k, std::int64_t vocab,
                        std::uintptr_t stream);

// Synchronizes `stream`, then returns and clears the first error a state kernel
// recorded on `device` ("" when none).
std::string take_kernel_error(int device, std::uintptr_t stream);

}  // namespace ortspec::cuda
