// A non-owning view of a dense, row-major tensor: pointer, dtype, shape, device.
//
// Kernels take TensorRefs so that they neither know nor care who owns the
// memory (a StepScopedArena block, a PersistentBuffers entry, a numpy array, a
// pointer handed over from ONNX Runtime or torch). Ownership is the caller's
// business; a TensorRef is only valid while its owner keeps the memory alive.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace ortspec {

enum class DeviceKind : std::uint8_t { kCpu, kCuda };

struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;  // CUDA ordinal; always 0 for the CPU

  static Device cpu() { return Device{DeviceKind::kCpu, 0}; }
  static Device cuda(int index) { return Device{DeviceKind::kCuda, index}; }
  bool is_cuda() const { return kind == DeviceKind::kCuda; }
  bool operator==(const Device& other) const {
    return kind == other.kind && index == other.index;
  }
  bool operator!=(const Device& other) const { return !(*this == other); }
  // "cpu" or "cuda:0".
  std::string to_string() const;
};

// Parses "cpu", "cuda" (index 0 unless device_index says otherwise) or "cuda:N".
Device parse_device(const std::string& name, int device_index = 0);

using Shape = std::vector<std::int64_t>;

// "[2, 5]"
std::string shape_to_string(const Shape& shape);

// Product of the dimensions; 1 for a scalar (empty shape).
std::int64_t shape_numel(const Shape& shape);

struct TensorRef {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Shape shape;
  Device device;

  std::int64_t numel() const { return shape_numel(shape); }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype); }
  std::size_t ndim() const { return shape.size(); }
  template <typename T>
  T* as() const { return static_cast<T*>(data); }
  // "int64[2, 5] on cpu"
  std::string describe() const;
};

}  // namespace ortspec
