// Python classes for running the host ahead of the GPU (core/streams.h): Stream, Event,
// pinned_host_buffer and copy_to_host. Every call that may wait releases the GIL.
#include <pybind11/stl.h>

#include "core/streams.h"
#include "python/bindings.h"

namespace ortspec::python {

void bind_streams(py::module_& module) {
  py::class_<Stream>(module, "Stream", R"doc(
A non-blocking CUDA stream (it never waits for the legacy default stream 0).

Give ``handle`` to ONNX Runtime (CUDA provider option user_compute_stream, as a decimal
string) and to every native call's ``stream`` argument: then ONNX Runtime's work and
ortspec's are ordered by the stream itself, and the host waits only where it reads a
result. The stream is destroyed with the object; work already enqueued still completes.)doc")
      .def(py::init<int>(), py::arg("device_index") = 0)
      .def_property_readonly("handle", &Stream::handle)
      .def_property_readonly("device_index", &Stream::device)
      .def("synchronize", &Stream::synchronize, py::call_guard<py::gil_scoped_release>(),
           "Waits for everything enqueued so far.")
      .def("idle", &Stream::idle, "Whether everything enqueued so far has finished; never blocks.")
      .def("__repr__", [](const Stream& s) {
        return "Stream(cuda:" + std::to_string(s.device()) + ", handle=" + std::to_string(s.handle()) + ")";
      });

  py::class_<Event>(module, "Event", R"doc(
A CUDA event without timing data: record(stream) after some work, then done() (never
blocks) or synchronize() (blocks) say whether that work has finished.)doc")
      .def(py::init<int>(), py::arg("device_index") = 0)
      .def(
          "record", [](Event& e, py::handle stream) { e.record(stream_arg(stream)); }, py::arg("stream"),
          "Marks the point after all work enqueued on stream so far.")
      .def("done", &Event::done, "Whether the work before the last record() has finished; never blocks.")
      .def("synchronize", &Event::synchronize, py::call_guard<py::gil_scoped_release>(),
           "Blocks until the work before the last record() has finished.")
      .def_property_readonly("device_index", &Event::device);

  module.def(
      "pinned_host_buffer",
      [](const Shape& shape, py::handle dtype) { return pinned_host_buffer(shape, dtype_arg(dtype)); },
      py::arg("shape"), py::arg("dtype"),
      "A zero-filled CPU Buffer in page-locked memory (cudaMallocHost): copy_to_host into it "
      "returns at once. Read it (numpy()) after an Event recorded behind the copy is done.");

  module.def(
      "copy_to_host",
      [](py::handle dst, py::handle src, py::handle stream) {
        TensorRef dst_ref = tensor_arg(dst, "copy_to_host", "dst", true);
        TensorRef src_ref = tensor_arg(src, "copy_to_host", "src", false);
        std::uintptr_t stream_handle = stream_arg(stream);
        py::gil_scoped_release release;
        copy_to_host_async(dst_ref, src_ref, stream_handle);
      },
      py::arg("dst"), py::arg("src"), py::arg("stream") = 0,
      "dst (CPU: a pinned_host_buffer, or a numpy array) <- src (CUDA), same dtype and shape, "
      "enqueued on stream; does not wait (into pageable memory CUDA itself waits for the copy).");
}

}  // namespace ortspec::python
