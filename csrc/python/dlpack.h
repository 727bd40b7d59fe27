// The DLPack C ABI (https://github.com/dmlc/dlpack, v0.8, Apache-2.0): just the
// structs ortspec exports, so that the build needs no dlpack package.
//
// Consumers (onnxruntime.OrtValue.from_dlpack, torch.from_dlpack,
// numpy.from_dlpack) receive a PyCapsule named "dltensor" holding a
// DLManagedTensor; they rename it "used_dltensor" and call `deleter` when done.
#pragma once

#include <cstdint>

namespace ortspec::dlpack {

enum DeviceType : std::int32_t { kDLCPU = 1, kDLCUDA = 2 };

struct DLDevice {
  std::int32_t device_type;  // DeviceType
  std::int32_t device_id;
};

enum TypeCode : std::uint8_t { kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4 };

struct DLDataType {
  std::uint8_t code;   // TypeCode
  std::uint8_t bits;
  std::uint16_t lanes;
};

struct DLTensor {
  void* data;
  DLDevice device;
  std::int32_t ndim;
  DLDataType dtype;
  std::int64_t* shape;    // [ndim]
  std::int64_t* strides;  // [ndim], in elements; may be null for compact row-major
  std::uint64_t byte_offset;
};

struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

}  // namespace ortspec::dlpack
