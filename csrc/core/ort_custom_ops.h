// What the Python module reads of core/ort_custom_ops.cpp (the ops themselves are found by ONNX
// Runtime through the exported RegisterCustomOps).
#pragma once

#include <atomic>
#include <cstdint>

namespace ortspec::ort {

// The CUDA stream the last ai.ortspec kernel on the CUDA provider was launched on (0: none yet):
// the GPU tests check it is the session's compute stream.
extern std::atomic<std::uintptr_t> g_last_cuda_stream;

}  // namespace ortspec::ort
