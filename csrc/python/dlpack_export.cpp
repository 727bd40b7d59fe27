// Zero-copy export of ortspec buffers through DLPack, so that
// onnxruntime.OrtValue.from_dlpack, torch.from_dlpack and numpy.from_dlpack can
// wrap memory that ortspec._native owns (device or host) without copying it.
#include <memory>
#include <vector>

#include "python/bindings.h"
#include "python/dlpack.h"

namespace ortspec::python {
namespace {

using dlpack::DLManagedTensor;

constexpr const char* kCapsuleName = "dltensor";
constexpr const char* kUsedCapsuleName = "used_dltensor";

// What a capsule owns: the DLPack struct, the shape/strides it points into, and
// a reference on the memory's owner. Freed by the consumer through `deleter`,
// or by the capsule's destructor if nobody consumed it. Holds no Python
// objects, so the deleter may run on any thread without the GIL.
struct DLPackExport {
  DLManagedTensor managed{};
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;
  std::shared_ptr<const void> keep_alive;
};

void delete_export(DLManagedTensor* self) { delete static_cast<DLPackExport*>(self->manager_ctx); }

void destroy_unconsumed_capsule(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, kUsedCapsuleName)) return;  // a consumer owns it now
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
  if (managed == nullptr) {
    PyErr_Clear();
    return;
  }
  managed->deleter(managed);
}

dlpack::DLDataType dlpack_dtype(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return {dlpack::kDLFloat, 32, 1};
    case DType::kFloat16: return {dlpack::kDLFloat, 16, 1};
    case DType::kBFloat16: return {dlpack::kDLBfloat, 16, 1};
    case DType::kInt32: return {dlpack::kDLInt, 32, 1};
    case DType::kInt64: return {dlpack::kDLInt, 64, 1};
  }
  return {dlpack::kDLFloat, 32, 1};
}

dlpack::DLDevice dlpack_device_of(const Device& device) {
  if (device.is_cuda()) return {dlpack::kDLCUDA, device.index};
  return {dlpack::kDLCPU, 0};
}

}  // namespace

py::capsule to_dlpack_capsule(const Buffer& buffer) {
  const TensorRef& ref = buffer.ref();  // throws for stale arena blocks
  auto exported = std::make_unique<DLPackExport>();
  exported->shape = ref.shape;
  exported->strides.assign(ref.shape.size(), 1);
  for (std::size_t i = ref.shape.size(); i-- > 1;) {  // row-major strides, in elements
    exported->strides[i - 1] = exported->strides[i] * ref.shape[i];
  }
  exported->keep_alive = buffer.keep_alive();
  dlpack::DLTensor& tensor = exported->managed.dl_tensor;
  tensor.data = ref.data;
  tensor.device = dlpack_device_of(ref.device);
  tensor.ndim = static_cast<std::int32_t>(ref.shape.size());
  tensor.dtype = dlpack_dtype(ref.dtype);
  tensor.shape = exported->shape.data();
  tensor.strides = exported->strides.data();
  tensor.byte_offset = 0;
  exported->managed.manager_ctx = exported.get();
  exported->managed.deleter = delete_export;
  DLManagedTensor* managed = &exported.release()->managed;
  return py::capsule(managed, kCapsuleName, destroy_unconsumed_capsule);
}

py::tuple dlpack_device(const Buffer& buffer) {
  dlpack::DLDevice device = dlpack_device_of(buffer.unchecked_ref().device);
  return py::make_tuple(device.device_type, device.device_id);
}

}  // namespace ortspec::python
