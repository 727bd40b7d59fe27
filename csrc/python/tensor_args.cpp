// Python values -> core types, with errors that name the function, the
// argument, what was wrong and what to pass instead.
#include <string>

#include "core/dtype.h"
#include "core/errors.h"
#include "python/bindings.h"

namespace ortspec::python {
namespace {

// numpy dtype -> DType for kernel inputs; bfloat16 has no numpy dtype.
bool dtype_from_numpy(const py::dtype& dtype, DType* out) {
  char byteorder = dtype.byteorder();
  if (byteorder == '>') return false;  // only native little-endian data
  char kind = dtype.kind();
  py::ssize_t size = dtype.itemsize();
  if (kind == 'f' && size == 4) { *out = DType::kFloat32; return true; }
  if (kind == 'f' && size == 2) { *out = DType::kFloat16; return true; }
  if (kind == 'i' && size == 4) { *out = DType::kInt32; return true; }
  if (kind == 'i' && size == 8) { *out = DType::kInt64; return true; }
  return false;
}

TensorRef tensor_from_numpy(const py::array& array, const char* op, const char* name,
                            bool writable) {
  DType dtype;
  if (!dtype_from_numpy(array.dtype(), &dtype)) {
    throw DTypeError(std::string(op) + ": " + name + " has numpy dtype " +
                     std::string(py::str(array.dtype())) +
                     "; use float32, float16, int32 or int64 (native byte order)");
  }
  if (!(array.flags() & py::array::c_style)) {
    throw std::invalid_argument(std::string(op) + ": " + name +
                                " must be C-contiguous; pass numpy.ascontiguousarray(" + name +
                                ")");
  }
  if (writable && !array.writeable()) {
    throw std::invalid_argument(std::string(op) + ": " + name +
                                " is an output but the numpy array is read-only");
  }
  Shape shape(array.shape(), array.shape() + array.ndim());
  return TensorRef{const_cast<void*>(array.data()), dtype, std::move(shape), Device::cpu()};
}

}  // namespace

DType dtype_arg(py::handle dtype) {
  if (py::isinstance<py::str>(dtype)) return dtype_from_name(dtype.cast<std::string>());
  std::string text = py::str(dtype);
  if (text.rfind("torch.", 0) == 0) return dtype_from_name(text.substr(6));  // torch.float16
  try {
    py::object numpy_dtype = py::module_::import("numpy").attr("dtype")(dtype);
    return dtype_from_name(numpy_dtype.attr("name").cast<std::string>());
  } catch (const py::error_already_set&) {
    throw DTypeError("unsupported dtype " + text +
                     ": use one of float32, float16, bfloat16, int32, int64");
  }
}

py::dtype numpy_dtype(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return py::dtype("float32");
    case DType::kFloat16: return py::dtype("float16");
    case DType::kBFloat16: return py::dtype("uint16");  // bit pattern
    case DType::kInt32: return py::dtype("int32");
    case DType::kInt64: return py::dtype("int64");
  }
  throw DTypeError("unknown DType value");
}

TensorRef tensor_arg(py::handle value, const char* op, const char* name, bool writable) {
  if (py::isinstance<Buffer>(value)) return value.cast<const Buffer&>().ref();
  if (py::isinstance<py::array>(value)) {
    return tensor_from_numpy(py::reinterpret_borrow<py::array>(value), op, name, writable);
  }
  std::string type_name = py::str(py::type::handle_of(value).attr("__name__"));
  throw DTypeError(std::string(op) + ": " + name +
                   " must be a numpy.ndarray (CPU) or an ortspec._native.Buffer, got " +
                   type_name +
                   "; wrap memory you own elsewhere with Buffer.from_pointer(data_ptr, shape, "
                   "dtype, device)");
}

std::uintptr_t stream_arg(py::handle stream) {
  if (stream.is_none()) return 0;
  if (!py::isinstance<py::int_>(stream)) {
    throw DTypeError("stream must be an int cudaStream_t handle (0 = default stream), got " +
                     std::string(py::str(py::type::handle_of(stream).attr("__name__"))));
  }
  return stream.cast<std::uintptr_t>();
}

}  // namespace ortspec::python
