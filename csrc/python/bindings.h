// Shared pieces of the pybind11 module ortspec._native (module.cpp): one
// bind_* function per Python-facing area, and the argument conversions they
// share, so that every function checks Python inputs the same way.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

#include "core/arena.h"
#include "core/tensor_ref.h"

namespace ortspec::python {

namespace py = pybind11;

void bind_buffers(py::module_& module);        // Buffer, StepScopedArena, PersistentBuffers
void bind_state_kernels(py::module_& module);  // select_slots, write_rows, ...
void bind_graph_slots(py::module_& module);    // GraphSlotKey, GraphSlotRegistry
void bind_streams(py::module_& module);        // Stream, Event, pinned_host_buffer, copy_to_host

// ---- tensor_args.cpp ---------------------------------------------------------

// A dtype given as "float32", numpy.float32 / numpy.dtype, or torch.float32.
DType dtype_arg(py::handle dtype);

// numpy dtype for a buffer's elements; bfloat16 appears as its uint16 bit pattern.
py::dtype numpy_dtype(DType dtype);

// The TensorRef behind a kernel argument: an ortspec Buffer (any device) or a
// C-contiguous numpy array of a supported dtype (CPU). `op` and `name` make the
// TypeError / ValueError say which argument of which function was wrong.
// `writable` refuses read-only numpy arrays for outputs.
TensorRef tensor_arg(py::handle value, const char* op, const char* name, bool writable);

// Python int (cudaStream_t handle, 0 = default stream) -> integer handle.
std::uintptr_t stream_arg(py::handle stream);

// ---- dlpack_export.cpp -------------------------------------------------------

// A "dltensor" PyCapsule viewing the buffer; the capsule keeps the owner alive.
py::capsule to_dlpack_capsule(const Buffer& buffer);

// (device_type, device_id) as DLPack numbers them: (1, 0) CPU, (2, n) CUDA.
py::tuple dlpack_device(const Buffer& buffer);

}  // namespace ortspec::python
