// CUDA runtime calls for ortspec._native: devices, memory, streams.
//
// Linked against the static CUDA runtime (setup.py, CMakeLists.txt): importing
// the extension then needs no libcudart on the library path, and the runtime
// looks for the driver (libcuda) only on the first CUDA call. So the module
// imports on a machine without a GPU or driver; the functions below report
// "no CUDA device" when called there.
#include <cuda_runtime.h>

#include <cstring>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>

#include "cuda/cuda_backend.h"

namespace ortspec::cuda {
namespace {

struct DeviceCountProbe {
  int count = 0;
  std::string reason;  // why count is 0
};

// cudaGetDeviceCount once per process: the answer does not change, and on a
// machine without a driver each call would repeat the failed driver lookup.
const DeviceCountProbe& probe_devices() {
  static const DeviceCountProbe probe = [] {
    DeviceCountProbe result;
    cudaError_t status = cudaGetDeviceCount(&result.count);
    if (status != cudaSuccess) {
      result.count = 0;
      result.reason = std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status);
      cudaGetLastError();  // clear the (non-sticky) error so later calls start clean
    } else if (result.count == 0) {
      result.reason = "cudaGetDeviceCount found 0 devices";
    }
    return result;
  }();
  return probe;
}

void check(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return;
  cudaGetLastError();
  throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorName(status) + ": " +
                           cudaGetErrorString(status));
}

cudaStream_t as_stream(std::uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

// Runs `call` with `device` current, then restores the previous device and clears any error:
// for the release paths, which run in destructors and must never throw.
template <typename Call>
void on_device_quietly(int device, Call call) noexcept {
  int previous = -1;
  cudaGetDevice(&previous);
  cudaSetDevice(device);
  call();
  if (previous >= 0) cudaSetDevice(previous);
  cudaGetLastError();
}

}  // namespace

int device_count() noexcept { return probe_devices().count; }

std::string no_device_reason() { return probe_devices().reason; }

int compiled_runtime_version() noexcept { return CUDART_VERSION; }

int runtime_version() noexcept {
  int version = 0;
  if (cudaRuntimeGetVersion(&version) != cudaSuccess) { cudaGetLastError(); return 0; }
  return version;
}

int driver_version() noexcept {
  int version = 0;
  if (cudaDriverGetVersion(&version) != cudaSuccess) { cudaGetLastError(); return 0; }
  return version;
}

DeviceGuard::DeviceGuard(int device) {
  const DeviceCountProbe& probe = probe_devices();
  if (probe.count == 0) {
    throw std::runtime_error(
        "no CUDA device: ortspec._native was built with CUDA, but this machine has no usable "
        "GPU or driver (" + probe.reason + "). Use device='cpu', or run on a GPU host.");
  }
  if (device < 0 || device >= probe.count) {
    throw std::runtime_error("CUDA device index " + std::to_string(device) +
                             " is out of range: this machine has " +
                             std::to_string(probe.count) + " CUDA device(s)");
  }
  check(cudaGetDevice(&previous_device_), "cudaGetDevice");
  if (previous_device_ != device) check(cudaSetDevice(device), "cudaSetDevice");
}

DeviceGuard::~DeviceGuard() {
  int current = -1;
  if (previous_device_ >= 0 && cudaGetDevice(&current) == cudaSuccess &&
      current != previous_device_) {
    cudaSetDevice(previous_device_);
  }
}

void* allocate(std::size_t nbytes, int device) {
  DeviceGuard guard(device);
  void* pointer = nullptr;
  cudaError_t status = cudaMalloc(&pointer, nbytes);
  if (status != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error("cudaMalloc of " + std::to_string(nbytes) + " bytes on cuda:" +
                             std::to_string(device) + " failed: " + cudaGetErrorString(status));
  }
  // Zero-fill so that fresh state buffers are deterministic; one-time cost.
  check(cudaMemset(pointer, 0, nbytes), "cudaMemset");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize after allocation");
  return pointer;
}

void release(void* pointer, int device) noexcept {
  if (pointer == nullptr) return;
  on_device_quietly(device, [&] { cudaFree(pointer); });
}

void copy_async(void* dst, const void* src, std::size_t nbytes, CopyKind kind, int device,
                std::uintptr_t stream) {
  DeviceGuard guard(device);
  cudaMemcpyKind cuda_kind = kind == CopyKind::kHostToDevice   ? cudaMemcpyHostToDevice
                             : kind == CopyKind::kDeviceToHost ? cudaMemcpyDeviceToHost
                                                               : cudaMemcpyDeviceToDevice;
  check(cudaMemcpyAsync(dst, src, nbytes, cuda_kind, as_stream(stream)), "cudaMemcpyAsync");
}

void copy_peer_async(void* dst, int dst_device, const void* src, int src_device,
                     std::size_t nbytes, std::uintptr_t stream) {
  DeviceGuard guard(dst_device);
  static std::mutex mutex;
  static std::set<std::pair<int, int>> tried;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (tried.insert({dst_device, src_device}).second) {
      int can_access = 0;
      check(cudaDeviceCanAccessPeer(&can_access, dst_device, src_device), "cudaDeviceCanAccessPeer");
      if (can_access) {
        cudaError_t status = cudaDeviceEnablePeerAccess(src_device, 0);
        if (status == cudaErrorPeerAccessAlreadyEnabled) {
          cudaGetLastError();
        } else {
          check(status, "cudaDeviceEnablePeerAccess");
        }
      }  // else cudaMemcpyPeerAsync stages the copy through the host
    }
  }
  check(cudaMemcpyPeerAsync(dst, dst_device, src, src_device, nbytes, as_stream(stream)),
        "cudaMemcpyPeerAsync");
}

void fill_zero_async(void* dst, std::size_t nbytes, int device, std::uintptr_t stream) {
  DeviceGuard guard(device);
  check(cudaMemsetAsync(dst, 0, nbytes, as_stream(stream)), "cudaMemsetAsync");
}

void synchronize(int device, std::uintptr_t stream) {
  DeviceGuard guard(device);
  check(cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize");
}

std::uintptr_t create_stream(int device) {
  DeviceGuard guard(device);
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  return reinterpret_cast<std::uintptr_t>(stream);
}

void destroy_stream(std::uintptr_t stream, int device) noexcept {
  if (stream == 0) return;
  // Returns at once; work already enqueued still completes.
  on_device_quietly(device, [&] { cudaStreamDestroy(as_stream(stream)); });
}

// cudaSuccess -> true, cudaErrorNotReady -> false, anything else throws.
static bool ready(cudaError_t status, const char* what) {
  if (status == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  check(status, what);
  return true;
}

bool stream_idle(std::uintptr_t stream, int device) {
  DeviceGuard guard(device);
  return ready(cudaStreamQuery(as_stream(stream)), "cudaStreamQuery");
}

std::uintptr_t create_event(int device) {
  DeviceGuard guard(device);
  cudaEvent_t event = nullptr;
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  return reinterpret_cast<std::uintptr_t>(event);
}

void destroy_event(std::uintptr_t event, int device) noexcept {
  if (event == 0) return;
  on_device_quietly(device, [&] { cudaEventDestroy(reinterpret_cast<cudaEvent_t>(event)); });
}

void record_event(std::uintptr_t event, std::uintptr_t stream, int device) {
  DeviceGuard guard(device);
  check(cudaEventRecord(reinterpret_cast<cudaEvent_t>(event), as_stream(stream)), "cudaEventRecord");
}

bool event_done(std::uintptr_t event, int device) {
  DeviceGuard guard(device);
  return ready(cudaEventQuery(reinterpret_cast<cudaEvent_t>(event)), "cudaEventQuery");
}

void synchronize_event(std::uintptr_t event, int device) {
  DeviceGuard guard(device);
  check(cudaEventSynchronize(reinterpret_cast<cudaEvent_t>(event)), "cudaEventSynchronize");
}

void* allocate_pinned(std::size_t nbytes) {
  if (probe_devices().count == 0) {
    throw std::runtime_error("page-locked host memory needs a CUDA device (" + probe_devices().reason +
                             "); run on a GPU host, or use numpy arrays on the CPU.");
  }
  void* pointer = nullptr;
  cudaError_t status = cudaMallocHost(&pointer, nbytes);
  if (status != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error("cudaMallocHost of " + std::to_string(nbytes) +
                             " bytes failed: " + cudaGetErrorString(status));
  }
  std::memset(pointer, 0, nbytes);
  return pointer;
}

void release_pinned(void* pointer) noexcept {
  if (pointer == nullptr) return;
  cudaFreeHost(pointer);
  cudaGetLastError();
}

}  // namespace ortspec::cuda
