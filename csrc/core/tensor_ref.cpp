#include "core/tensor_ref.h"

#include <stdexcept>

namespace ortspec {

std::string Device::to_string() const {
  if (kind == DeviceKind::kCpu) return "cpu";
  return "cuda:" + std::to_string(index);
}

Device parse_device(const std::string& name, int device_index) {
  if (name == "cpu") return Device::cpu();
  if (name == "cuda") return Device::cuda(device_index);
  if (name.rfind("cuda:", 0) == 0) {
    try {
      return Device::cuda(std::stoi(name.substr(5)));
    } catch (const std::exception&) {
      // fall through to the error below
    }
  }
  throw std::invalid_argument("unknown device '" + name + "': use 'cpu', 'cuda' or 'cuda:N'");
}

std::string shape_to_string(const Shape& shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(shape[i]);
  }
  return text + "]";
}

std::int64_t shape_numel(const Shape& shape) {
  std::int64_t numel = 1;
  for (std::int64_t dim : shape) {
    if (dim < 0) throw std::invalid_argument("negative dimension in shape " + shape_to_string(shape));
    numel *= dim;
  }
  return numel;
}

std::string TensorRef::describe() const {
  return std::string(dtype_name(dtype)) + shape_to_string(shape) + " on " + device.to_string();
}

}  // namespace ortspec
