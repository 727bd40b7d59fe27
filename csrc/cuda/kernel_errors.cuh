// Launch checks and the device-side error record of a .cu file's kernels (state_kernels.cu, transition_kernels.cu).
// A kernel cannot throw: the first one that meets a bad index records it in its file's
// __device__ KernelErrorRecord, leaves the affected row as documented, and the host reads and
// clears the record at its next sync point (take_kernel_error()).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace ortspec::cuda {

struct KernelErrorRecord {
  int kernel;          // the failing kernel's id in its file; 0 when clear
  long long row;       // batch row b
  long long column;    // j for write_rows positions[b, j]; 0 otherwise
  long long value;     // the bad index / count / position
  long long limit;     // the bound it broke (W, M or L)
};

inline cudaStream_t as_stream(std::uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

// After a launch: a launch that failed (bad configuration, no device) throws, naming the kernel.
inline void check_launch(const char* kernel) {
  cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(kernel) + " launch failed: " + cudaGetErrorString(status));
  }
}

// Called by one thread per bad row: the first call of any kernel since the last read wins.
__device__ inline void record_first_error(KernelErrorRecord& record, int kernel, long long row, long long value,
                                          long long limit, long long column = 0) {
  if (atomicCAS(&record.kernel, 0, kernel) == 0) {
    record.row = row;
    record.column = column;
    record.value = value;
    record.limit = limit;
  }
}

// Reads the record `symbol` (a __device__ KernelErrorRecord) and clears it when set; waits for
// `stream`. what: the kernels it belongs to, for the message of a failed read.
inline KernelErrorRecord take_error_record(const KernelErrorRecord& symbol, cudaStream_t stream, const char* what) {
  KernelErrorRecord record{};
  cudaError_t status = cudaMemcpyFromSymbolAsync(&record, symbol, sizeof(record), 0, cudaMemcpyDeviceToHost, stream);
  if (status == cudaSuccess) status = cudaStreamSynchronize(stream);
  if (status == cudaSuccess && record.kernel != 0) {
    const KernelErrorRecord cleared{0, 0, 0, 0, 0};
    status = cudaMemcpyToSymbolAsync(symbol, &cleared, sizeof(cleared), 0, cudaMemcpyHostToDevice, stream);
    if (status == cudaSuccess) status = cudaStreamSynchronize(stream);
  }
  if (status != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(std::string("reading the ") + what + " error record failed: " +
                             cudaGetErrorString(status));
  }
  return record;
}

}  // namespace ortspec::cuda
