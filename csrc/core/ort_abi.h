// The few pieces of ONNX Runtime's C ABI that a custom-op library needs, declared by hand: the
// onnxruntime wheels ship no headers, and this module must build where only the wheel is installed.
//
// The ABI is stable by construction: OrtApi is a table of function pointers that only ever grows
// at its end (a runtime hands out the table of the version asked for), and OrtCustomOp is a struct
// whose `version` field tells the runtime how many of its fields to read. So a function is named
// here by its position in the table, fixed since the API version that added it, and the struct by
// its fields up to those of version 16 (KernelComputeV2, which can return an error). The
// positions are those of the C API's header at version 13; core/ort_custom_ops.cpp checks a few of
// them against the running library when it registers the ops.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ortspec::ort {

struct Status;
struct KernelInfo;
struct KernelContext;
struct Value;
struct TensorInfo;
struct SessionOptions;
struct OpDomain;
struct Api;

constexpr std::uint32_t kApiVersion = 16;  // CreateKernelV2 / KernelComputeV2: ONNX Runtime >= 1.16

enum ElementType : int { kFloat = 1, kInt64 = 7 };
enum ErrorCode : int { kFail = 1, kInvalidArgument = 2 };

struct ApiBase {
  const Api* (*GetApi)(std::uint32_t version);
  const char* (*GetVersionString)();
};

// The functions ortspec calls, by their positions in OrtApi.
class ApiTable {
 public:
  explicit ApiTable(const Api* api) : slots_(reinterpret_cast<const void* const*>(api)) {}

  Status* CreateStatus(int code, const char* message) const { return at<Status* (*)(int, const char*)>(0)(code, message); }
  const char* GetErrorMessage(const Status* status) const { return at<const char* (*)(const Status*)>(2)(status); }
  Status* CreateCustomOpDomain(const char* domain, OpDomain** out) const {
    return at<Status* (*)(const char*, OpDomain**)>(26)(domain, out);
  }
  Status* CustomOpDomain_Add(OpDomain* domain, const void* op) const {
    return at<Status* (*)(OpDomain*, const void*)>(27)(domain, op);
  }
  Status* AddCustomOpDomain(SessionOptions* options, OpDomain* domain) const {
    return at<Status* (*)(SessionOptions*, OpDomain*)>(28)(options, domain);
  }
  Status* IsTensor(const Value* value, int* out) const { return at<Status* (*)(const Value*, int*)>(50)(value, out); }
  Status* GetTensorMutableData(Value* value, void** out) const {
    return at<Status* (*)(Value*, void**)>(51)(value, out);
  }
  Status* GetTensorElementType(const TensorInfo* info, int* out) const {
    return at<Status* (*)(const TensorInfo*, int*)>(60)(info, out);
  }
  Status* GetDimensionsCount(const TensorInfo* info, std::size_t* out) const {
    return at<Status* (*)(const TensorInfo*, std::size_t*)>(61)(info, out);
  }
  Status* GetDimensions(const TensorInfo* info, std::int64_t* dims, std::size_t count) const {
    return at<Status* (*)(const TensorInfo*, std::int64_t*, std::size_t)>(62)(info, dims, count);
  }
  Status* GetTensorTypeAndShape(const Value* value, TensorInfo** out) const {
    return at<Status* (*)(const Value*, TensorInfo**)>(65)(value, out);
  }
  Status* KernelContext_GetInputCount(const KernelContext* context, std::size_t* out) const {
    return at<Status* (*)(const KernelContext*, std::size_t*)>(88)(context, out);
  }
  Status* KernelContext_GetInput(const KernelContext* context, std::size_t index, const Value** out) const {
    return at<Status* (*)(const KernelContext*, std::size_t, const Value**)>(90)(context, index, out);
  }
  Status* KernelContext_GetOutput(KernelContext* context, std::size_t index, const std::int64_t* dims,
                                  std::size_t count, Value** out) const {
    return at<Status* (*)(KernelContext*, std::size_t, const std::int64_t*, std::size_t, Value**)>(91)(
        context, index, dims, count, out);
  }
  void ReleaseStatus(Status* status) const { at<void (*)(Status*)>(93)(status); }
  void ReleaseTensorTypeAndShapeInfo(TensorInfo* info) const { at<void (*)(TensorInfo*)>(99)(info); }
  Status* GetAvailableProviders(char*** out, int* count) const { return at<Status* (*)(char***, int*)>(125)(out, count); }
  Status* ReleaseAvailableProviders(char** providers, int count) const {
    return at<Status* (*)(char**, int)>(126)(providers, count);
  }
  Status* HasValue(const Value* value, int* out) const { return at<Status* (*)(const Value*, int*)>(192)(value, out); }
  Status* KernelContext_GetGPUComputeStream(const KernelContext* context, void** out) const {
    return at<Status* (*)(const KernelContext*, void**)>(193)(context, out);
  }

 private:
  template <typename F>
  F at(int index) const { return reinterpret_cast<F>(const_cast<void*>(slots_[index])); }

  const void* const* slots_;
};

// OrtCustomOp through version 16's fields and the ones after it (null or trivial here), so that a
// runtime reading a field of its own version finds something safe.
struct CustomOp {
  std::uint32_t version;
  void* (*CreateKernel)(const CustomOp* op, const Api* api, const KernelInfo* info);
  const char* (*GetName)(const CustomOp* op);
  const char* (*GetExecutionProviderType)(const CustomOp* op);
  int (*GetInputType)(const CustomOp* op, std::size_t index);
  std::size_t (*GetInputTypeCount)(const CustomOp* op);
  int (*GetOutputType)(const CustomOp* op, std::size_t index);
  std::size_t (*GetOutputTypeCount)(const CustomOp* op);
  void (*KernelCompute)(void* kernel, KernelContext* context);
  void (*KernelDestroy)(void* kernel);
  int (*GetInputCharacteristic)(const CustomOp* op, std::size_t index);   // 0: required
  int (*GetOutputCharacteristic)(const CustomOp* op, std::size_t index);  // 0: required
  int (*GetInputMemoryType)(const CustomOp* op, std::size_t index);       // 0: the provider's default
  int (*GetVariadicInputMinArity)(const CustomOp* op);
  int (*GetVariadicInputHomogeneity)(const CustomOp* op);
  int (*GetVariadicOutputMinArity)(const CustomOp* op);
  int (*GetVariadicOutputHomogeneity)(const CustomOp* op);
  Status* (*CreateKernelV2)(const CustomOp* op, const Api* api, const KernelInfo* info, void** kernel);
  Status* (*KernelComputeV2)(void* kernel, KernelContext* context);
  Status* (*InferOutputShapeFn)(const CustomOp* op, void* context);
  int (*GetStartVersion)(const CustomOp* op);
  int (*GetEndVersion)(const CustomOp* op);
  std::size_t (*GetMayInplace)(int** input_index, int** output_index);
  void (*ReleaseMayInplace)(int* input_index, int* output_index);
  std::size_t (*GetAliasMap)(int** input_index, int** output_index);
  void (*ReleaseAliasMap)(int* input_index, int* output_index);
};

}  // namespace ortspec::ort
