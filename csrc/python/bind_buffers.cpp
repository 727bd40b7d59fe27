// Python classes for ortspec-owned memory: Buffer (a typed view), the
// StepScopedArena (per-step scratch) and PersistentBuffers (named state).
//
// Zero-copy in both directions: CPU buffers become numpy arrays whose base is
// the Buffer (numpy()/__array__); any buffer becomes a DLPack capsule
// (__dlpack__) for onnxruntime.OrtValue.from_dlpack or torch.from_dlpack.
// Explicit copies (to_numpy, copy_from_numpy) work on both devices.
#include <pybind11/stl.h>

#include <cstdio>
#include <stdexcept>
#include <string>

#include "core/device_memory.h"
#include "core/errors.h"
#include "python/bindings.h"

namespace ortspec::python {
namespace {

std::string buffer_repr(const Buffer& buffer) {
  const TensorRef& ref = buffer.unchecked_ref();
  char address[32];
  std::snprintf(address, sizeof(address), "0x%llx",
                static_cast<unsigned long long>(reinterpret_cast<std::uintptr_t>(ref.data)));
  std::string text = "Buffer(" + ref.describe();
  if (!buffer.name().empty()) text += ", name='" + buffer.name() + "'";
  text += std::string(", data_ptr=") + address;
  if (!buffer.is_live()) text += ", STALE";
  if (!buffer.owns_memory()) text += ", borrowed";
  return text + ")";
}

// Zero-copy numpy view of a CPU buffer; `owner` (the Python Buffer) becomes its base.
py::array numpy_view(const Buffer& buffer, py::handle owner) {
  const TensorRef& ref = buffer.ref();
  if (ref.device.is_cuda()) {
    throw DTypeError("Buffer on " + ref.device.to_string() +
                     " has no numpy view: copy it with to_numpy(stream), or wrap it with "
                     "torch.from_dlpack(buffer) / onnxruntime.OrtValue.from_dlpack(buffer)");
  }
  return py::array(numpy_dtype(ref.dtype), ref.shape, {}, ref.data, owner);
}

py::array copy_to_numpy(const Buffer& buffer, std::uintptr_t stream) {
  const TensorRef& ref = buffer.ref();
  py::array host(numpy_dtype(ref.dtype), ref.shape);
  {
    py::gil_scoped_release release;
    copy_bytes(host.mutable_data(), Device::cpu(), ref.data, ref.device, ref.nbytes(), stream);
    synchronize(ref.device, stream);
  }
  return host;
}

void copy_from_numpy(const Buffer& buffer, const py::array& source, std::uintptr_t stream) {
  const TensorRef& ref = buffer.ref();
  py::array contiguous = py::array::ensure(source, py::array::c_style);
  if (!contiguous) throw py::error_already_set();
  if (!contiguous.dtype().equal(numpy_dtype(ref.dtype))) {
    throw DTypeError("copy_from_numpy: buffer is " + std::string(dtype_name(ref.dtype)) +
                     " (numpy " + std::string(py::str(numpy_dtype(ref.dtype))) +
                     "), array is " + std::string(py::str(contiguous.dtype())) +
                     "; convert with array.astype(...) first");
  }
  Shape shape(contiguous.shape(), contiguous.shape() + contiguous.ndim());
  if (shape != ref.shape) {
    throw std::invalid_argument("copy_from_numpy: buffer shape is " + shape_to_string(ref.shape) +
                                ", array shape is " + shape_to_string(shape));
  }
  py::gil_scoped_release release;
  copy_bytes(ref.data, ref.device, contiguous.data(), Device::cpu(), ref.nbytes(), stream);
}

void bind_buffer(py::module_& module) {
  py::class_<Buffer>(module, "Buffer", R"doc(
A typed view of memory, usually owned by a StepScopedArena or PersistentBuffers.

Keeps its owner alive. An arena block goes stale when StepScopedArena.reset()
hands its bytes back; using it then raises RuntimeError. Exports without copies:
numpy()/__array__ (CPU), __dlpack__ (CPU and CUDA; for OrtValue.from_dlpack and
torch.from_dlpack). bfloat16 appears in numpy as its uint16 bit pattern.)doc")
      .def_static(
          "from_pointer",
          [](std::uintptr_t data_ptr, const Shape& shape, py::handle dtype,
             const std::string& device, int device_index) {
            TensorRef ref{reinterpret_cast<void*>(data_ptr), dtype_arg(dtype), shape,
                          parse_device(device, device_index)};
            ref.numel();  // validates the shape
            return Buffer::borrowed(std::move(ref));
          },
          py::arg("data_ptr"), py::arg("shape"), py::arg("dtype"), py::arg("device") = "cuda",
          py::arg("device_index") = 0,
          "A borrowed view of memory owned elsewhere (OrtValue.data_ptr(), "
          "torch.Tensor.data_ptr()); the caller keeps that memory alive.")
      .def_property_readonly("data_ptr", [](const Buffer& b) {
        return reinterpret_cast<std::uintptr_t>(b.unchecked_ref().data);
      })
      .def_property_readonly("shape", [](const Buffer& b) {
        return py::tuple(py::cast(b.unchecked_ref().shape));
      })
      .def_property_readonly("dtype", [](const Buffer& b) {
        return std::string(dtype_name(b.unchecked_ref().dtype));
      })
      .def_property_readonly("device", [](const Buffer& b) {
        return b.unchecked_ref().device.is_cuda() ? "cuda" : "cpu";
      })
      .def_property_readonly("device_index", [](const Buffer& b) {
        return b.unchecked_ref().device.index;
      })
      .def_property_readonly("ndim", [](const Buffer& b) { return b.unchecked_ref().ndim(); })
      .def_property_readonly("numel", [](const Buffer& b) { return b.unchecked_ref().numel(); })
      .def_property_readonly("nbytes", [](const Buffer& b) { return b.unchecked_ref().nbytes(); })
      .def_property_readonly("name", &Buffer::name)
      .def_property_readonly("is_live", &Buffer::is_live)
      .def_property_readonly("owns_memory", &Buffer::owns_memory)
      .def("numpy", [](py::object self) { return numpy_view(self.cast<const Buffer&>(), self); },
           "Zero-copy numpy view (CPU buffers only).")
      .def(
          "__array__",
          [](py::object self, py::object dtype, py::object copy) -> py::object {
            py::array view = numpy_view(self.cast<const Buffer&>(), self);
            if (!dtype.is_none()) return view.attr("astype")(dtype);
            if (!copy.is_none() && copy.cast<bool>()) return view.attr("copy")();
            return std::move(view);
          },
          py::arg("dtype") = py::none(), py::arg("copy") = py::none())
      .def(
          "to_numpy",
          [](const Buffer& b, py::handle stream) { return copy_to_numpy(b, stream_arg(stream)); },
          py::arg("stream") = 0, "A host copy (any device); synchronizes the stream.")
      .def(
          "copy_from_numpy",
          [](const Buffer& b, const py::array& source, py::handle stream) {
            copy_from_numpy(b, source, stream_arg(stream));
          },
          py::arg("array"), py::arg("stream") = 0,
          "Copies a host array of the same shape and dtype in (asynchronous on CUDA).")
      .def(
          "zero_",
          [](const Buffer& b, py::handle stream) {
            const TensorRef& ref = b.ref();
            fill_zero(ref.data, ref.device, ref.nbytes(), stream_arg(stream));
          },
          py::arg("stream") = 0)
      .def(
          "__dlpack__",
          [](const Buffer& b, py::object stream, py::object max_version, py::object dl_device,
             py::object copy) {
            (void)stream;  // ortspec work is ordered on the caller's one shared stream
            (void)max_version;  // a legacy "dltensor" capsule is accepted by every consumer
            if (!copy.is_none() && copy.cast<bool>()) {
              throw py::buffer_error("Buffer.__dlpack__(copy=True) is not supported: "
                                     "ortspec exports its memory only without copying");
            }
            if (!dl_device.is_none() && !dl_device.equal(dlpack_device(b))) {
              throw py::buffer_error("Buffer.__dlpack__: cannot export to another device");
            }
            return to_dlpack_capsule(b);
          },
          py::kw_only(), py::arg("stream") = py::none(), py::arg("max_version") = py::none(),
          py::arg("dl_device") = py::none(), py::arg("copy") = py::none())
      .def("__dlpack_device__", &dlpack_device)
      .def("__repr__", &buffer_repr);
}

void bind_arena(py::module_& module) {
  py::class_<StepScopedArena, std::shared_ptr<StepScopedArena>>(module, "StepScopedArena", R"doc(
Per-step scratch: one fixed region, 256-byte-aligned bump allocation.

reset() once per step hands back every block allocated since the last pin().
pin() before a CUDA graph capture: the blocks allocated so far keep their bytes
for good (the graph holds their addresses). unpin_all() only after every graph
holding them is released. Overflow raises ArenaOverflowError.)doc")
      .def(py::init([](std::size_t capacity_bytes, const std::string& device, int device_index) {
             return StepScopedArena::create(capacity_bytes, parse_device(device, device_index));
           }),
           py::arg("capacity_bytes"), py::arg("device") = "cpu", py::arg("device_index") = 0)
      .def(
          "allocate",
          [](StepScopedArena& arena, const Shape& shape, py::handle dtype) {
            return arena.allocate(shape, dtype_arg(dtype));
          },
          py::arg("shape"), py::arg("dtype"))
      .def("reset", &StepScopedArena::reset)
      .def("pin", &StepScopedArena::pin)
      .def("unpin_all", &StepScopedArena::unpin_all)
      .def_property_readonly("capacity_bytes", &StepScopedArena::capacity_bytes)
      .def_property_readonly("used_bytes", &StepScopedArena::used_bytes)
      .def_property_readonly("pinned_bytes", &StepScopedArena::pinned_bytes)
      .def_property_readonly("available_bytes", &StepScopedArena::available_bytes)
      .def_property_readonly("peak_bytes", &StepScopedArena::peak_bytes)
      .def_property_readonly("generation", &StepScopedArena::generation)
      .def_property_readonly("device", [](const StepScopedArena& a) {
        return a.device().is_cuda() ? "cuda" : "cpu";
      })
      .def_property_readonly("device_index", [](const StepScopedArena& a) {
        return a.device().index;
      })
      .def_property_readonly("base_ptr", [](const StepScopedArena& a) {
        return reinterpret_cast<std::uintptr_t>(a.base());
      })
      .def("__repr__", [](const StepScopedArena& a) {
        return "StepScopedArena(" + a.device().to_string() + ", used " +
               std::to_string(a.used_bytes()) + " of " + std::to_string(a.capacity_bytes()) +
               " bytes, pinned " + std::to_string(a.pinned_bytes()) + ")";
      });
}

void bind_persistent_buffers(py::module_& module) {
  py::class_<PersistentBuffers>(module, "PersistentBuffers", R"doc(
Named buffers (recurrent state, KV cache, positions), zero-filled, allocated
once each; their addresses never change for the Session's life. allocate()
raises ValueError for a name already taken; get() raises KeyError.)doc")
      .def(py::init([](const std::string& device, int device_index) {
             return PersistentBuffers(parse_device(device, device_index));
           }),
           py::arg("device") = "cpu", py::arg("device_index") = 0)
      .def(
          "allocate",
          [](PersistentBuffers& buffers, const std::string& name, const Shape& shape,
             py::handle dtype) { return buffers.allocate(name, shape, dtype_arg(dtype)); },
          py::arg("name"), py::arg("shape"), py::arg("dtype"))
      .def("get", [](const PersistentBuffers& buffers, const std::string& name) {
        try {
          return buffers.get(name);
        } catch (const std::out_of_range& error) {
          throw py::key_error(error.what());
        }
      }, py::arg("name"))
      .def("__getitem__", [](const PersistentBuffers& buffers, const std::string& name) {
        try {
          return buffers.get(name);
        } catch (const std::out_of_range& error) {
          throw py::key_error(error.what());
        }
      })
      .def("__contains__", &PersistentBuffers::contains)
      .def("__len__", [](const PersistentBuffers& buffers) { return buffers.names().size(); })
      .def("names", &PersistentBuffers::names, "Names in allocation order.")
      .def_property_readonly("total_bytes", &PersistentBuffers::total_bytes)
      .def_property_readonly("device", [](const PersistentBuffers& b) {
        return b.device().is_cuda() ? "cuda" : "cpu";
      })
      .def(
          "zero_all",
          [](PersistentBuffers& buffers, py::handle stream) { buffers.zero_all(stream_arg(stream)); },
          py::arg("stream") = 0);
}

}  // namespace

void bind_buffers(py::module_& module) {
  bind_buffer(module);
  bind_arena(module);
  bind_persistent_buffers(module);
}

}  // namespace ortspec::python
