// Step mechanics of speculative decoding: accept, select, snapshot/restore,
// advance, emit. One entry point per operation, on the CPU or a CUDA device.
//
// Shapes (B requests, k drafts, W state-window slots, N = features per row):
//   accept_lengths         drafts int64[B,k], targets int64[B,k+1] -> accepted int64[B]
//                          accepted[b] = max a <= k with drafts[b,i] == targets[b,i] for i < a
//   select_slots           window T[W,B,...], index int64[B] -> live T[B,...]
//                          live[b] = window[index[b], b]    (T any dtype, copied bitwise)
//   copy_buffer            dst <- src, same dtype/shape/device (snapshot / restore)
//   advance_positions      positions I[B] += accepted + 1; seq_lens J[B] += accepted + 1
//                          (I, J each int32 or int64; accepted int64[B])
//   gather_accepted_tokens drafts int64[B,k], targets int64[B,k+1], accepted int64[B]
//                          -> out int64[B,k+1] = drafts[b,:a] ++ [targets[b,a]] ++ [-1]*(k-a)
//
// Each entry point checks devices, dtypes and shapes (DTypeError or
// std::invalid_argument naming the function and argument), then runs the CPU
// reference below or the CUDA twin (cuda/state_kernels.cu) asynchronously on
// `stream`. Data-dependent checks (an index out of range) throw at once on the
// CPU, before anything is written; on CUDA the kernel records the first one,
// leaves the row as documented, and take_kernel_error() reports it.
#pragma once

#include <cstdint>
#include <string>

#include "core/tensor_ref.h"

namespace ortspec {

void accept_lengths(const TensorRef& drafts, const TensorRef& targets, const TensorRef& accepted,
                    std::uintptr_t stream = 0);
void select_slots(const TensorRef& window, const TensorRef& index, const TensorRef& live,
                  std::uintptr_t stream = 0);
void copy_buffer(const TensorRef& dst, const TensorRef& src, std::uintptr_t stream = 0);
void advance_positions(const TensorRef& positions, const TensorRef& seq_lens,
                       const TensorRef& accepted, std::uintptr_t stream = 0);
void gather_accepted_tokens(const TensorRef& drafts, const TensorRef& targets,
                            const TensorRef& accepted, const TensorRef& out,
                            std::uintptr_t stream = 0);

// The first error a CUDA state kernel recorded on `device` since the last call
// ("" when none; always "" for the CPU). Synchronizes `stream`.
std::string take_kernel_error(Device device, std::uintptr_t stream = 0);

// CPU reference implementations on validated, contiguous memory. The CUDA
// kernels must match these exactly; the native tests compare them.
namespace cpu {

void accept_lengths(const std::int64_t* drafts, const std::int64_t* targets,
                    std::int64_t* accepted, std::int64_t batch, std::int64_t num_drafts);
void select_slots(const void* window, const std::int64_t* index, void* live,
                  std::int64_t num_slots, std::int64_t batch, std::size_t row_bytes);
template <typename Position, typename SeqLen>
void advance_positions(Position* positions, SeqLen* seq_lens, const std::int64_t* accepted,
                       std::int64_t batch);
void gather_accepted_tokens(const std::int64_t* drafts, const std::int64_t* targets,
                            const std::int64_t* accepted, std::int64_t* out,
                            std::int64_t batch, std::int64_t num_drafts);

}  // namespace cpu
}  // namespace ortspec
