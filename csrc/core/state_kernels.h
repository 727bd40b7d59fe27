// State mechanics of speculative decoding: commit by select, snapshot/restore,
// KV row writes, row gathers. One entry point per operation, on the CPU or a CUDA
// device. (The acceptance rule itself is numpy in ortspec/speculative/decoder.py:
// the accepted lengths are needed on the host to emit tokens.)
//
// Shapes (B requests, W state-window slots, M rows per request):
//   select_slots           window T[W,B,...], index int64[B] -> live T[B,...]
//                          live[b] = window[index[b], b]    (T any dtype, copied bitwise)
//   copy_buffer            dst <- src, same dtype/shape; one device, or two GPUs (proxies
//                          handed between pipeline stages)
//   write_rows             cache T[B,d1..,L,e1..] (position axis `axis` >= 1, length L),
//                          rows T[B,d1..,M,e1..], positions int64[B,M], counts int64[B]
//                          (optional, none = M); viewed as cache [B,P,L,Q], rows [B,P,M,Q]:
//                          cache[b,p,positions[b,j],q] = rows[b,p,j,q] for j < counts[b]
//                          (T float32/float16/bfloat16, copied bitwise; KV cache append)
//   gather_rows            src T[B,M,...], index int64[B] -> dst T[B,...]
//                          dst[b] = src[b, index[b]]   (T any dtype, copied bitwise)
//   advance_decode_inputs  tokens, ids, positions int64[B,1], last_position:
//                          ids[b] = tokens[b]; positions[b] = min(positions[b] + 1, last_position)
//                          (the next decode step's inputs, made on the device)
//   advance_speculative_inputs  step_ids int64[B,2k+2] (tokens g_0..g_k | accepted a | drafts),
//                          ids, positions, verified int64[B,k+1], counts int64[B], last_start:
//                          counts[b] = a + 1; verified[b] = positions[b] (what the commit writes at);
//                          ids[b] = [g_a, drafts]; positions[b, j] = min(T + a + 1, last_start) + j
//                          with T = positions[b, 0] (the next speculative step's inputs, on the device)
//
// Each entry point checks devices, dtypes and shapes (DTypeError or
// std::invalid_argument naming the function and argument), then runs the CPU
// reference below or the CUDA twin (cuda/state_kernels.cu) asynchronously on
// `stream`. Data-dependent checks (an index out of range) throw at once on the
// CPU, before anything is written; on CUDA the kernel records the first one,
// leaves the row as documented, and take_kernel_error() reports it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor_ref.h"

namespace ortspec {

void select_slots(const TensorRef& window, const TensorRef& index, const TensorRef& live,
                  std::uintptr_t stream = 0);
void copy_buffer(const TensorRef& dst, const TensorRef& src, std::uintptr_t stream = 0);
// copy_buffer for every (dst, src) pair, all checked first. On CUDA the pairs on one device
// whose addresses and sizes are multiples of 16 bytes, none overlapping another, are copied in
// one kernel launch; the rest one by one (peer copies between GPUs among them).
void copy_buffers(const std::vector<std::pair<TensorRef, TensorRef>>& pairs, std::uintptr_t stream = 0);
// The checks of select_slots / copy_buffer alone (throwing what they throw), for a caller
// that validates a whole batch of calls before it runs any.
Device check_select_slots(const TensorRef& window, const TensorRef& index, const TensorRef& live);
void check_copy_buffer(const TensorRef& dst, const TensorRef& src);
// `axis` counts from the front (1..rank-1) or, when negative, from the back
// (-1 = the last dimension); the batch axis 0 cannot be the position axis.
// Positions written for one request should be distinct: the CPU applies the
// entries in order j = 0, 1, ... (the last duplicate wins), CUDA writes them
// concurrently (an unspecified duplicate wins).
void write_rows(const TensorRef& cache, const TensorRef& rows, const TensorRef& positions,
                const std::optional<TensorRef>& counts, std::int64_t axis,
                std::uintptr_t stream = 0);
void gather_rows(const TensorRef& src, const TensorRef& index, const TensorRef& dst,
                 std::uintptr_t stream = 0);

// The next decode step's inputs without the host: ids <- this step's tokens, positions one on
// (at most last_position, where a finished row stays parked inside the buffers).
void advance_decode_inputs(const TensorRef& tokens, const TensorRef& ids, const TensorRef& positions,
                           std::int64_t last_position, std::uintptr_t stream = 0);

// The next speculative step's inputs and this step's commit counts without the host, from the
// step_ids a verify_mtp_k{k} run wrote (module comment above). A row whose accepted length is
// outside 0..k: the CPU throws before anything is written; CUDA records it, leaves that row's ids
// and positions as they were and sets its count to 0 (the commit then writes nothing for it).
void advance_speculative_inputs(const TensorRef& step_ids, const TensorRef& ids, const TensorRef& positions,
                                const TensorRef& verified, const TensorRef& counts, std::int64_t last_start,
                                std::uintptr_t stream = 0);

// The first error a CUDA state kernel recorded on `device` since the last call
// ("" when none; always "" for the CPU). Synchronizes `stream`.
std::string take_kernel_error(Device device, std::uintptr_t stream = 0);

// CPU reference implementations on validated, contiguous memory. The CUDA
// kernels must match these exactly; the native tests compare them.
namespace cpu {

void select_slots(const void* window, const std::int64_t* index, void* live,
                  std::int64_t num_slots, std::int64_t batch, std::size_t row_bytes);
// cache [B, P, L, row_bytes], rows [B, P, M, row_bytes], positions [B, M],
// counts [B] or nullptr (all M rows).
void write_rows(void* cache, const void* rows, const std::int64_t* positions,
                const std::int64_t* counts, std::int64_t batch, std::int64_t outer,
                std::int64_t cache_length, std::int64_t num_rows, std::size_t row_bytes);
// src [B, M, row_bytes], index [B] -> dst [B, row_bytes].
void gather_rows(const void* src, const std::int64_t* index, void* dst, std::int64_t batch,
                 std::int64_t num_rows, std::size_t row_bytes);
// tokens, ids, positions [B].
void advance_decode_inputs(const std::int64_t* tokens, std::int64_t* ids, std::int64_t* positions,
                           std::int64_t batch, std::int64_t last_position);
// step_ids [B, 2k+2], ids / positions / verified [B, k+1], counts [B].
void advance_speculative_inputs(const std::int64_t* step_ids, std::int64_t* ids, std::int64_t* positions,
                                std::int64_t* verified, std::int64_t* counts, std::int64_t batch,
                                std::int64_t k, std::int64_t last_start);

}  // namespace cpu
}  // namespace ortspec
