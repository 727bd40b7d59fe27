// ortspec's custom ops for ONNX Runtime, domain ai.ortspec: SamplingThreshold, Draw, SampleToken,
// TransformRows and SpeculativeAccept (core/sampling_ops.h), each for the CPU and, in a CUDA build, the CUDA execution provider.
// ONNX Runtime loads them from this module's own file: SessionOptions.register_custom_ops_library
// calls RegisterCustomOps below (ortspec/runtime/custom_ops.py does, for every session).
//
// On the CUDA provider a kernel runs on the stream ONNX Runtime hands it (the session's compute
// stream, ortspec's user_compute_stream), so it is captured into CUDA graphs like the ops around
// it; it launches one kernel per op and allocates nothing.
#include <atomic>
#include <climits>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "core/ort_abi.h"
#include "core/ort_custom_ops.h"
#include "core/sampling_ops.h"

#ifdef ORTSPEC_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace ortspec::ort {

std::atomic<std::uintptr_t> g_last_cuda_stream{0};

namespace {

constexpr const char* kDomain = "ai.ortspec";
constexpr const char* kCuda = "CUDAExecutionProvider";

// A status for ONNX Runtime, or nullptr (success).
struct Failure {
  int code;
  std::string message;
};

struct Tensor {
  void* data = nullptr;
  std::vector<std::int64_t> dims;
};

class Context {
 public:
  Context(const ApiTable& api, KernelContext* context) : api_(api), context_(context) {}

  Tensor input(std::size_t index) const {
    const Value* value = nullptr;
    check(api_.KernelContext_GetInput(context_, index, &value));
    Tensor tensor;
    TensorInfo* info = nullptr;
    check(api_.GetTensorTypeAndShape(value, &info));
    std::size_t rank = 0;
    Status* status = api_.GetDimensionsCount(info, &rank);
    if (!status) {
      tensor.dims.resize(rank);
      status = api_.GetDimensions(info, tensor.dims.data(), rank);
    }
    api_.ReleaseTensorTypeAndShapeInfo(info);
    check(status);
    check(api_.GetTensorMutableData(const_cast<Value*>(value), &tensor.data));
    return tensor;
  }

  void* output(std::size_t index, const std::vector<std::int64_t>& dims) const {
    Value* value = nullptr;
    check(api_.KernelContext_GetOutput(context_, index, dims.data(), dims.size(), &value));
    void* data = nullptr;
    check(api_.GetTensorMutableData(value, &data));
    return data;
  }

  std::uintptr_t cuda_stream() const {
    void* stream = nullptr;
    check(api_.KernelContext_GetGPUComputeStream(context_, &stream));
    if (!stream) throw Failure{kFail, "ai.ortspec op on CUDA: ONNX Runtime gave no compute stream"};
    return reinterpret_cast<std::uintptr_t>(stream);
  }

  // On the CPU provider: the ABI positions past the ones registration checked (module comment).
  void check_cpu_abi() const {
    static std::atomic<bool> checked{false};
    if (checked.load()) return;
    const Value* value = nullptr;
    check(api_.KernelContext_GetInput(context_, 0, &value));
    int has_value = 0, is_tensor = 0;
    void* stream = &has_value;  // a non-null start: the call must set it to nullptr
    check(api_.HasValue(value, &has_value));
    check(api_.IsTensor(value, &is_tensor));
    check(api_.KernelContext_GetGPUComputeStream(context_, &stream));
    if (has_value != 1 || is_tensor != 1 || stream != nullptr) {
      throw Failure{kFail, "ortspec's custom ops do not match this ONNX Runtime's C API (HasValue, IsTensor, "
                           "KernelContext_GetGPUComputeStream answered wrongly); use onnxruntime >= 1.16"};
    }
    checked.store(true);
  }

 private:
  void check(Status* status) const {
    if (!status) return;
    std::string message = api_.GetErrorMessage(status);
    api_.ReleaseStatus(status);
    throw Failure{kFail, message};
  }

  const ApiTable& api_;
  KernelContext* context_;
};

void require(bool condition, const std::string& message) {
  if (!condition) throw Failure{kInvalidArgument, message};
}

std::string dims_text(const std::vector<std::int64_t>& dims) {
  std::string text = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

// SamplingThreshold(z f32[B, N, V], probs f32[B, N, V], top_k i64[B], top_p f32[B]) -> f32[B, N, 1]
void sampling_threshold(const Context& context, bool cuda) {
  const Tensor z = context.input(0), probs = context.input(1), top_k = context.input(2), top_p = context.input(3);
  require(z.dims.size() == 3 && z.dims[2] > 0, "SamplingThreshold: z must be [B, N, V] with V > 0, got " + dims_text(z.dims));
  require(probs.dims == z.dims, "SamplingThreshold: probs " + dims_text(probs.dims) + " must match z " + dims_text(z.dims));
  const std::vector<std::int64_t> per_request{z.dims[0]};
  require(top_k.dims == per_request && top_p.dims == per_request,
          "SamplingThreshold: top_k " + dims_text(top_k.dims) + " and top_p " + dims_text(top_p.dims) + " must be [B]");
  auto* threshold = static_cast<float*>(context.output(0, {z.dims[0], z.dims[1], 1}));
  const std::int64_t rows = z.dims[0] * z.dims[1];
  const auto* zp = static_cast<const float*>(z.data);
  const auto* pp = static_cast<const float*>(probs.data);
  const auto* kp = static_cast<const std::int64_t*>(top_k.data);
  const auto* tp = static_cast<const float*>(top_p.data);
#ifdef ORTSPEC_WITH_CUDA
  if (cuda) {
    const std::uintptr_t stream = context.cuda_stream();
    g_last_cuda_stream.store(stream);
    cuda::sampling_threshold(zp, pp, kp, tp, threshold, rows, z.dims[1], z.dims[2], stream);
    return;
  }
#endif
  (void)cuda;
  context.check_cpu_abi();
  sampling::cpu::sampling_threshold(zp, pp, kp, tp, threshold, rows, z.dims[1], z.dims[2]);
}

// Draw(weights f32[B, N, V], u f32[B, N]) -> i64[B, N]
void draw(const Context& context, bool cuda) {
  const Tensor weights = context.input(0), u = context.input(1);
  require(weights.dims.size() == 3 && weights.dims[2] > 0,
          "Draw: weights must be [B, N, V] with V > 0, got " + dims_text(weights.dims));
  const std::vector<std::int64_t> rows_shape{weights.dims[0], weights.dims[1]};
  require(u.dims == rows_shape, "Draw: u " + dims_text(u.dims) + " must be " + dims_text(rows_shape));
  auto* index = static_cast<std::int64_t*>(context.output(0, rows_shape));
  const std::int64_t rows = weights.dims[0] * weights.dims[1];
  const auto* wp = static_cast<const float*>(weights.data);
  const auto* up = static_cast<const float*>(u.data);
#ifdef ORTSPEC_WITH_CUDA
  if (cuda) {
    const std::uintptr_t stream = context.cuda_stream();
    g_last_cuda_stream.store(stream);
    cuda::draw(wp, up, index, rows, weights.dims[2], stream);
    return;
  }
#endif
  (void)cuda;
  context.check_cpu_abi();
  sampling::cpu::draw(wp, up, index, rows, weights.dims[2]);
}

// SampleToken(logits f32[B, N, V], greedy i64[B, N], temperature, top_k, top_p, min_p [B], u f32[B, N]) -> i64[B, N]
void sample_token(const Context& context, bool cuda) {
  const Tensor logits = context.input(0), greedy = context.input(1), temperature = context.input(2),
               top_k = context.input(3), top_p = context.input(4), min_p = context.input(5), u = context.input(6);
  require(logits.dims.size() == 3 && logits.dims[2] > 0,
          "SampleToken: logits must be [B, N, V] with V > 0, got " + dims_text(logits.dims));
  const std::vector<std::int64_t> rows_shape{logits.dims[0], logits.dims[1]}, per_request{logits.dims[0]};
  require(greedy.dims == rows_shape && u.dims == rows_shape,
          "SampleToken: greedy " + dims_text(greedy.dims) + " and u " + dims_text(u.dims) + " must be " +
              dims_text(rows_shape));
  require(temperature.dims == per_request && top_k.dims == per_request && top_p.dims == per_request &&
              min_p.dims == per_request,
          "SampleToken: temperature " + dims_text(temperature.dims) + ", top_k " + dims_text(top_k.dims) + ", top_p " +
              dims_text(top_p.dims) + " and min_p " + dims_text(min_p.dims) + " must be [B]");
  auto* token = static_cast<std::int64_t*>(context.output(0, rows_shape));
  const std::int64_t rows = logits.dims[0] * logits.dims[1];
  const auto* lp = static_cast<const float*>(logits.data);
  const auto* gp = static_cast<const std::int64_t*>(greedy.data);
  const auto* tp = static_cast<const float*>(temperature.data);
  const auto* kp = static_cast<const std::int64_t*>(top_k.data);
  const auto* pp = static_cast<const float*>(top_p.data);
  const auto* mp = static_cast<const float*>(min_p.data);
  const auto* up = static_cast<const float*>(u.data);
#ifdef ORTSPEC_WITH_CUDA
  if (cuda) {
    const std::uintptr_t stream = context.cuda_stream();
    g_last_cuda_stream.store(stream);
    cuda::sample_token(lp, gp, tp, kp, pp, mp, up, token, rows, logits.dims[1], logits.dims[2], stream);
    return;
  }
#endif
  (void)cuda;
  context.check_cpu_abi();
  sampling::cpu::sample_token(lp, gp, tp, kp, pp, mp, up, token, rows, logits.dims[1], logits.dims[2]);
}

// TransformRows(logits f32[B, N, V], temperature, top_k, top_p, min_p [B]) -> i64[B, N, 3]
void transform_rows(const Context& context, bool cuda) {
  const Tensor logits = context.input(0), temperature = context.input(1), top_k = context.input(2),
               top_p = context.input(3), min_p = context.input(4);
  require(logits.dims.size() == 3 && logits.dims[2] > 0,
          "TransformRows: logits must be [B, N, V] with V > 0, got " + dims_text(logits.dims));
  const std::vector<std::int64_t> per_request{logits.dims[0]};
  require(temperature.dims == per_request && top_k.dims == per_request && top_p.dims == per_request &&
              min_p.dims == per_request,
          "TransformRows: temperature " + dims_text(temperature.dims) + ", top_k " + dims_text(top_k.dims) +
              ", top_p " + dims_text(top_p.dims) + " and min_p " + dims_text(min_p.dims) + " must be [B]");
  auto* stats = static_cast<std::int64_t*>(context.output(0, {logits.dims[0], logits.dims[1], 3}));
  const std::int64_t rows = logits.dims[0] * logits.dims[1];
  const auto* lp = static_cast<const float*>(logits.data);
  const auto* tp = static_cast<const float*>(temperature.data);
  const auto* kp = static_cast<const std::int64_t*>(top_k.data);
  const auto* pp = static_cast<const float*>(top_p.data);
  const auto* mp = static_cast<const float*>(min_p.data);
#ifdef ORTSPEC_WITH_CUDA
  if (cuda) {
    const std::uintptr_t stream = context.cuda_stream();
    g_last_cuda_stream.store(stream);
    cuda::transform_rows(lp, tp, kp, pp, mp, stats, rows, logits.dims[1], logits.dims[2], stream);
    return;
  }
#endif
  (void)cuda;
  context.check_cpu_abi();
  sampling::cpu::transform_rows(lp, tp, kp, pp, mp, stats, rows, logits.dims[1], logits.dims[2]);
}

// SpeculativeAccept(logits f32[B, k+1, V], stats i64[B, k+1, 3], drafts i64[B, k], q f32[B, k, V],
//                   temperature, min_p [B], u f32[B, k+1], greedy_accepted, greedy_token i64[B])
//   -> accepted i64[B], emitted i64[B]
void speculative_accept(const Context& context, bool cuda) {
  const Tensor logits = context.input(0), stats = context.input(1), drafts = context.input(2), q = context.input(3),
               temperature = context.input(4), min_p = context.input(5), u = context.input(6),
               greedy_accepted = context.input(7), greedy_token = context.input(8);
  require(logits.dims.size() == 3 && logits.dims[1] >= 2 && logits.dims[2] > 0,
          "SpeculativeAccept: logits must be [B, k+1, V] with k >= 1, got " + dims_text(logits.dims));
  const std::int64_t B = logits.dims[0], k = logits.dims[1] - 1, V = logits.dims[2];
  require(stats.dims == std::vector<std::int64_t>{B, k + 1, 3},
          "SpeculativeAccept: stats " + dims_text(stats.dims) + " must be [B, k+1, 3] (TransformRows of the logits)");
  require(drafts.dims == std::vector<std::int64_t>{B, k} && q.dims == std::vector<std::int64_t>{B, k, V},
          "SpeculativeAccept: drafts " + dims_text(drafts.dims) + " and q " + dims_text(q.dims) +
              " must be [B, k] and [B, k, V] for logits " + dims_text(logits.dims));
  const std::vector<std::int64_t> per_request{B};
  require(temperature.dims == per_request && min_p.dims == per_request && greedy_accepted.dims == per_request &&
              greedy_token.dims == per_request && u.dims == std::vector<std::int64_t>{B, k + 1},
          "SpeculativeAccept: temperature " + dims_text(temperature.dims) + ", min_p " + dims_text(min_p.dims) +
              ", greedy_accepted " + dims_text(greedy_accepted.dims) + " and greedy_token " +
              dims_text(greedy_token.dims) + " must be [B], u " + dims_text(u.dims) + " [B, k+1]");
  auto* accepted = static_cast<std::int64_t*>(context.output(0, per_request));
  auto* emitted = static_cast<std::int64_t*>(context.output(1, per_request));
  const auto* lp = static_cast<const float*>(logits.data);
  const auto* sp = static_cast<const std::int64_t*>(stats.data);
  const auto* dp = static_cast<const std::int64_t*>(drafts.data);
  const auto* qp = static_cast<const float*>(q.data);
  const auto* tp = static_cast<const float*>(temperature.data);
  const auto* mp = static_cast<const float*>(min_p.data);
  const auto* up = static_cast<const float*>(u.data);
  const auto* ga = static_cast<const std::int64_t*>(greedy_accepted.data);
  const auto* gt = static_cast<const std::int64_t*>(greedy_token.data);
#ifdef ORTSPEC_WITH_CUDA
  if (cuda) {
    const std::uintptr_t stream = context.cuda_stream();
    g_last_cuda_stream.store(stream);
    cuda::speculative_accept(lp, sp, dp, qp, tp, mp, up, ga, gt, accepted, emitted, B, k, V, stream);
    return;
  }
#endif
  (void)cuda;
  context.check_cpu_abi();
  sampling::cpu::speculative_accept(lp, sp, dp, qp, tp, mp, up, ga, gt, accepted, emitted, B, k, V);
}

struct OpSpec {
  const char* name;
  std::vector<int> inputs, outputs;
  void (*compute)(const Context&, bool cuda);
};

const OpSpec kThreshold{"SamplingThreshold", {kFloat, kFloat, kInt64, kFloat}, {kFloat}, sampling_threshold};
const OpSpec kDraw{"Draw", {kFloat, kFloat}, {kInt64}, draw};
const OpSpec kSampleToken{"SampleToken", {kFloat, kInt64, kFloat, kInt64, kFloat, kFloat, kFloat}, {kInt64}, sample_token};
const OpSpec kTransformRows{"TransformRows", {kFloat, kFloat, kInt64, kFloat, kFloat}, {kInt64}, transform_rows};
const OpSpec kSpeculativeAccept{"SpeculativeAccept",
                                {kFloat, kInt64, kInt64, kFloat, kFloat, kFloat, kFloat, kInt64, kInt64},
                                {kInt64, kInt64}, speculative_accept};

// One op for one provider: the OrtCustomOp ONNX Runtime reads, then what its callbacks need.
struct Op {
  CustomOp base;
  const OpSpec* spec;
  const char* provider;  // nullptr: the CPU
};

struct Kernel {
  ApiTable api;
  const Op* op;
};

const Op& op_of(const CustomOp* base) { return *reinterpret_cast<const Op*>(base); }

Status* create_kernel(const CustomOp* base, const Api* api, const KernelInfo*, void** kernel) {
  *kernel = new Kernel{ApiTable(api), &op_of(base)};
  return nullptr;
}

Status* compute(void* kernel_pointer, KernelContext* context) {
  const auto* kernel = static_cast<const Kernel*>(kernel_pointer);
  try {
    kernel->op->spec->compute(Context(kernel->api, context), kernel->op->provider != nullptr);
    return nullptr;
  } catch (const Failure& failure) {
    return kernel->api.CreateStatus(failure.code, failure.message.c_str());
  } catch (const std::exception& error) {
    return kernel->api.CreateStatus(kFail, (std::string(kernel->op->spec->name) + ": " + error.what()).c_str());
  }
}

Op make_op(const OpSpec& spec, const char* provider) {
  CustomOp base{};
  base.version = kApiVersion;
  base.CreateKernel = [](const CustomOp*, const Api*, const KernelInfo*) -> void* { return nullptr; };  // V2 instead
  base.GetName = [](const CustomOp* op) { return op_of(op).spec->name; };
  base.GetExecutionProviderType = [](const CustomOp* op) { return op_of(op).provider; };
  base.GetInputType = [](const CustomOp* op, std::size_t i) { return op_of(op).spec->inputs[i]; };
  base.GetInputTypeCount = [](const CustomOp* op) { return op_of(op).spec->inputs.size(); };
  base.GetOutputType = [](const CustomOp* op, std::size_t i) { return op_of(op).spec->outputs[i]; };
  base.GetOutputTypeCount = [](const CustomOp* op) { return op_of(op).spec->outputs.size(); };
  base.KernelCompute = [](void*, KernelContext*) {};  // V2 instead
  base.KernelDestroy = [](void* kernel) { delete static_cast<Kernel*>(kernel); };
  base.GetInputCharacteristic = [](const CustomOp*, std::size_t) { return 0; };
  base.GetOutputCharacteristic = [](const CustomOp*, std::size_t) { return 0; };
  base.GetInputMemoryType = [](const CustomOp*, std::size_t) { return 0; };
  base.GetVariadicInputMinArity = [](const CustomOp*) { return 1; };
  base.GetVariadicInputHomogeneity = [](const CustomOp*) { return 1; };
  base.GetVariadicOutputMinArity = [](const CustomOp*) { return 1; };
  base.GetVariadicOutputHomogeneity = [](const CustomOp*) { return 1; };
  base.CreateKernelV2 = create_kernel;
  base.KernelComputeV2 = compute;
  base.InferOutputShapeFn = nullptr;
  base.GetStartVersion = [](const CustomOp*) { return 1; };
  base.GetEndVersion = [](const CustomOp*) { return INT_MAX; };
  base.GetMayInplace = [](int** input_index, int** output_index) -> std::size_t {
    *input_index = *output_index = nullptr;
    return 0;
  };
  base.ReleaseMayInplace = [](int*, int*) {};
  base.GetAliasMap = [](int** input_index, int** output_index) -> std::size_t {
    *input_index = *output_index = nullptr;
    return 0;
  };
  base.ReleaseAliasMap = [](int*, int*) {};
  return Op{base, &spec, provider};
}

// Registration's ABI check: positions up to GetAvailableProviders (125, 126) answer as they must.
Status* check_api(const ApiTable& api) {
  char** providers = nullptr;
  int count = 0;
  if (Status* status = api.GetAvailableProviders(&providers, &count)) return status;
  bool cpu = false;
  for (int i = 0; i < count; ++i) cpu = cpu || std::strcmp(providers[i], "CPUExecutionProvider") == 0;
  if (Status* status = api.ReleaseAvailableProviders(providers, count)) return status;
  if (!cpu) {
    return api.CreateStatus(kFail, "ortspec's custom ops do not match this ONNX Runtime's C API "
                                   "(GetAvailableProviders has no CPUExecutionProvider); use onnxruntime >= 1.16");
  }
  return nullptr;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) Status* RegisterCustomOps(SessionOptions* options,
                                                                            const ApiBase* base) {
  const Api* raw = base->GetApi(kApiVersion);
  if (!raw) return nullptr;  // older than 1.16: no table to report an error with; the model's load names the op
  const ApiTable api(raw);
  if (Status* status = check_api(api)) return status;
  // The ops and their domain live as long as the process: ONNX Runtime keeps pointers to them.
  static std::vector<Op>* ops = [] {
    const OpSpec* specs[] = {&kThreshold, &kDraw, &kSampleToken, &kTransformRows, &kSpeculativeAccept};
    auto* made = new std::vector<Op>;
    for (const OpSpec* spec : specs) made->push_back(make_op(*spec, nullptr));
#ifdef ORTSPEC_WITH_CUDA
    for (const OpSpec* spec : specs) made->push_back(make_op(*spec, kCuda));
#endif
    return made;
  }();
  static OpDomain* domain = nullptr;
  static Status* domain_error = [&]() -> Status* {
    if (Status* status = api.CreateCustomOpDomain(kDomain, &domain)) return status;
    for (const Op& op : *ops) {
      if (Status* status = api.CustomOpDomain_Add(domain, &op.base)) return status;
    }
    return nullptr;
  }();
  if (domain_error) return api.CreateStatus(kFail, "ortspec: creating the ai.ortspec custom op domain failed");
  return api.AddCustomOpDomain(options, domain);
}

}  // namespace ortspec::ort
