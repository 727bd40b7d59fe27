// Element types that ortspec buffers and kernels understand.
//
// One enum shared by the arena, the state kernels, the DLPack export and the
// Python bindings, so that a dtype name means the same thing everywhere.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace ortspec {

enum class DType : std::uint8_t { kFloat32, kFloat16, kBFloat16, kInt32, kInt64 };

// Size of one element in bytes.
std::size_t dtype_size(DType dtype);

// "float32", "float16", "bfloat16", "int32", "int64".
const char* dtype_name(DType dtype);

// Inverse of dtype_name; throws DTypeError naming the accepted names.
DType dtype_from_name(const std::string& name);

}  // namespace ortspec
