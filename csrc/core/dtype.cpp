#include "core/dtype.h"

#include "core/errors.h"

namespace ortspec {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
  }
  throw DTypeError("unknown DType value");
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
  }
  throw DTypeError("unknown DType value");
}

DType dtype_from_name(const std::string& name) {
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kInt32,
                      DType::kInt64}) {
    if (name == dtype_name(dtype)) return dtype;
  }
  throw DTypeError("unsupported dtype '" + name +
                   "': use one of float32, float16, bfloat16, int32, int64");
}

}  // namespace ortspec
