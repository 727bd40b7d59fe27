// ortspec._native: memory, state kernels and graph slot bookkeeping for the
// ortspec runtime layer. See csrc/README.md for the layout and build.
//
// Exceptions: DTypeError -> TypeError, std::invalid_argument -> ValueError,
// ArenaOverflowError -> ortspec._native.ArenaOverflowError (RuntimeError),
// other std::exception -> RuntimeError.
#include <string>

#include "core/device_memory.h"
#include "core/errors.h"
#include "core/ort_custom_ops.h"
#include "python/bindings.h"

#ifdef ORTSPEC_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

#ifndef ORTSPEC_VERSION
#define ORTSPEC_VERSION "unknown"
#endif
#ifndef ORTSPEC_CUDA_ARCHS
#define ORTSPEC_CUDA_ARCHS ""
#endif

namespace ortspec::python {
namespace {

// "13.0" from 13000; None for 0 (unknown / not compiled).
py::object version_string(int version) {
  if (version <= 0) return py::none();
  return py::str(std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10));
}

py::dict build_info() {
  py::dict info;
  info["version"] = ORTSPEC_VERSION;
  info["cuda"] = cuda_compiled();
  info["alignment_bytes"] = kAlignmentBytes;
#ifdef ORTSPEC_WITH_CUDA
  info["cuda_arch"] = std::string(ORTSPEC_CUDA_ARCHS);
  info["cuda_version"] = version_string(cuda::compiled_runtime_version());
  info["cuda_runtime_version"] = version_string(cuda::runtime_version());
  info["cuda_driver_version"] = version_string(cuda::driver_version());
  info["cuda_device_count"] = cuda::device_count();
  info["cuda_unavailable_reason"] =
      cuda::device_count() > 0 ? py::object(py::none()) : py::object(py::str(cuda::no_device_reason()));
#else
  info["cuda_arch"] = py::none();
  info["cuda_version"] = py::none();
  info["cuda_runtime_version"] = py::none();
  info["cuda_driver_version"] = py::none();
  info["cuda_device_count"] = 0;
  info["cuda_unavailable_reason"] = "built without CUDA";
#endif
  return info;
}

void register_exceptions(py::module_& module) {
  py::register_exception<ArenaOverflowError>(module, "ArenaOverflowError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr pending) {
    try {
      if (pending) std::rethrow_exception(pending);
    } catch (const DTypeError& error) {
      PyErr_SetString(PyExc_TypeError, error.what());
    }
  });
}

}  // namespace
}  // namespace ortspec::python

PYBIND11_MODULE(_native, module) {
  namespace py = pybind11;
  using namespace ortspec::python;
  module.doc() =
      "ortspec native extension: StepScopedArena / PersistentBuffers (memory bound to ONNX "
      "Runtime), state kernels for the speculative step (CPU reference and CUDA), and "
      "GraphSlotRegistry (CUDA graph bookkeeping).";
  register_exceptions(module);
  module.attr("ALIGNMENT_BYTES") = ortspec::kAlignmentBytes;

  module.def("cuda_available", [] { return ortspec::cuda_device_count() > 0; },
             "True when this build has CUDA and the machine has a usable device.");
  module.def("device_count", &ortspec::cuda_device_count,
             "Usable CUDA devices (0 without CUDA build, GPU or driver).");
  module.def("build_info", &build_info,
             "dict: version, cuda (compiled), cuda_arch, cuda_version (toolkit), "
             "cuda_runtime_version, cuda_driver_version, cuda_device_count, "
             "cuda_unavailable_reason, alignment_bytes.");
  module.def(
      "synchronize",
      [](py::handle stream, int device_index) {
        std::uintptr_t handle = stream_arg(stream);
        py::gil_scoped_release release;
        ortspec::synchronize(ortspec::Device::cuda(device_index), handle);
      },
      py::arg("stream") = 0, py::arg("device_index") = 0,
      "Waits for all work on a CUDA stream (raises RuntimeError without a device).");

  module.def("last_custom_op_stream", [] { return ortspec::ort::g_last_cuda_stream.load(); },
             "The CUDA stream (an int) the last ai.ortspec op on the CUDA provider ran on; 0: none yet. "
             "The custom ops themselves are loaded by ONNX Runtime from this module's file "
             "(ortspec/runtime/custom_ops.py).");

  bind_buffers(module);
  bind_state_kernels(module);
  bind_graph_slots(module);
  bind_streams(module);
}
