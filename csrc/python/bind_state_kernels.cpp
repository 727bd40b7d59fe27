// Python entry points of the state kernels (core/state_kernels.h).
//
// Arguments are numpy arrays (CPU) or ortspec Buffers (CPU or CUDA); all of one
// call on one device. On CUDA the work is enqueued on `stream` (an int
// cudaStream_t, 0 = default; share it with ONNX Runtime's user_compute_stream)
// and nothing synchronizes: device-side index errors surface at the next
// check_device_errors(). Every output is passed in: no kernel allocates.
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/device_memory.h"
#include "core/errors.h"
#include "core/state_kernels.h"
#include "core/transition_kernels.h"
#include "python/bindings.h"

namespace ortspec::python {
namespace {

// Many calls in one: each call's own checks run first for all of them, so a bad one
// leaves every destination as it was; its error names which one.
void require_same_count(const char* op, const char* what, std::size_t count, const char* other,
                        std::size_t other_count) {
  if (count != other_count) {
    throw std::invalid_argument(std::string(op) + ": " + std::to_string(count) + " " + what + " for " +
                                std::to_string(other_count) + " " + other);
  }
}

template <typename Check>
void prefixed(const std::string& prefix, Check check) {
  try {
    check();
  } catch (const DTypeError& error) {
    throw DTypeError(prefix + error.what());
  } catch (const std::invalid_argument& error) {
    throw std::invalid_argument(prefix + error.what());
  }
}

}  // namespace

void bind_state_kernels(py::module_& module) {
  module.def(
      "select_slots",
      [](py::handle window, py::handle index, py::handle live, py::handle stream) {
        const char* op = "select_slots";
        TensorRef window_ref = tensor_arg(window, op, "window", false);
        TensorRef index_ref = tensor_arg(index, op, "index", false);
        TensorRef live_ref = tensor_arg(live, op, "live", true);
        std::uintptr_t stream_handle = stream_arg(stream);
        py::gil_scoped_release release;
        select_slots(window_ref, index_ref, live_ref, stream_handle);
      },
      py::arg("window"), py::arg("index"), py::arg("live"), py::arg("stream") = 0,
      R"doc(live[b] = window[index[b], b] (commit by select).

window T[W, B, ...] holds the state after each verify position, index
int64[B] the slot to keep (the accepted length), live T[B, ...] the live state.
Any dtype T, copied bitwise. An index outside 0..W-1 raises ValueError on the
CPU (nothing written); on CUDA that row is left unchanged and
check_device_errors() raises.)doc");

  module.def(
      "copy_buffer",
      [](py::handle dst, py::handle src, py::handle stream) {
        const char* op = "copy_buffer";
        TensorRef dst_ref = tensor_arg(dst, op, "dst", true);
        TensorRef src_ref = tensor_arg(src, op, "src", false);
        std::uintptr_t stream_handle = stream_arg(stream);
        py::gil_scoped_release release;
        copy_buffer(dst_ref, src_ref, stream_handle);
      },
      py::arg("dst"), py::arg("src"), py::arg("stream") = 0,
      "dst <- src, same shape and dtype, on one device or on two GPUs (a peer copy, on "
      "the destination's stream); asynchronous on stream on CUDA.");

  // Many states in one call: a step commits every GDN layer's state at once, and one
  // Python -> C++ crossing per layer was a measured share of the step's host time. Every
  // pair is validated before anything is written, so a bad one leaves all states as they were.
  module.def(
      "copy_buffers",
      [](const py::list& dsts, const py::list& srcs, py::handle stream) {
        const char* op = "copy_buffers";
        require_same_count(op, "destinations", dsts.size(), "sources", srcs.size());
        std::vector<std::pair<TensorRef, TensorRef>> pairs;
        for (std::size_t i = 0; i < dsts.size(); ++i) {
          TensorRef dst = tensor_arg(dsts[i], op, "dst", true);
          TensorRef src = tensor_arg(srcs[i], op, "src", false);
          prefixed(std::string(op) + ": pair " + std::to_string(i) + ": ", [&] { check_copy_buffer(dst, src); });
          pairs.emplace_back(dst, src);
        }
        std::uintptr_t stream_handle = stream_arg(stream);
        py::gil_scoped_release release;
        copy_buffers(pairs, stream_handle);
      },
      py::arg("dsts"), py::arg("srcs"), py::arg("stream") = 0,
      "copy_buffer for each (dsts[i], srcs[i]), all validated first; on CUDA the same-device "
      "pairs in one kernel launch (core/state_kernels.h says which).");

  module.def(
      "select_slots_many",
      [](const py::list& windows, py::handle index, const py::list& lives, py::handle stream) {
        const char* op = "select_slots_many";
        require_same_count(op, "windows", windows.size(), "states", lives.size());
        TensorRef index_ref = tensor_arg(index, op, "index", false);
        std::vector<std::pair<TensorRef, TensorRef>> pairs;
        for (std::size_t i = 0; i < windows.size(); ++i) {
          TensorRef window = tensor_arg(windows[i], op, "window", false);
          TensorRef live = tensor_arg(lives[i], op, "live", true);
          prefixed(std::string(op) + ": state " + std::to_string(i) + ": ",
                   [&] { check_select_slots(window, index_ref, live); });
          pairs.emplace_back(window, live);
        }
        std::uintptr_t stream_handle = stream_arg(stream);
        py::gil_scoped_release release;
        for (const auto& [window, live] : pairs) select_slots(window, index_ref, live, stream_handle);
      },
      py::arg("windows"), py::arg("index"), py::arg("lives"), py::arg("stream") = 0,
      "select_slots(windows[i], index, lives[i]) for each state, all validated first.");

  module.def(
      "write_rows",
      [](py::handle cache, py::handle rows, py::handle positions, py::handle counts,
         std::int64_t axis, py::handle stream) {
        const char* op = "write_rows";
        TensorRef cache_ref = tensor_arg(cache, op, "cache", true);
        TensorRef rows_ref = tensor_arg(rows, op, "rows", false);
        TensorRef positions_ref = tensor_arg(positions, op, "positions", false);
        std::optional<TensorRef> counts_ref;
        if (!counts.is_none()) counts_ref = tensor_arg(counts, op, "counts", false);
        std::uintptr_t stream_handle = stream_arg(stream);
        py::gil_scoped_release release;
        write_rows(cache_ref, rows_ref, positions_ref, counts_ref, axis, stream_handle);
      },
      py::arg("cache"), py::arg("rows"), py::arg("positions"), py::arg("counts") = py::none(),
      py::kw_only(), py::arg("axis"), py::arg("stream") = 0,
      R"doc(Writes new KV-cache rows in place: cache[b, ..., positions[b, j], ...] = rows[b, ..., j, ...].

cache T[B, d1.., L, e1..] with the position axis `axis` (keyword-only; 1..ndim-1,
or negative from the end) of length L; rows T[B, d1.., M, e1..] (cache's shape
with M at `axis`); positions int64[B, M]; counts int64[B] or None (all M).
T is float32, float16 or bfloat16 (copied bitwise). Viewing cache as [B, P, L, Q]
and rows as [B, P, M, Q]: cache[b, p, positions[b, j], q] = rows[b, p, j, q] for
j < counts[b]. Key cache [B, kvh, hd, L] takes axis=3, value cache [B, kvh, L, hd]
axis=2. Positions of one request should be distinct (CPU: the last duplicate
wins; CUDA: an unspecified one). A count outside 0..M or a written position
outside 0..L-1 raises ValueError on the CPU (nothing written); on CUDA the bad
request (count) or entry (position) is skipped and check_device_errors() raises.)doc");

  module.def(
      "gather_rows",
      [](py::handle src, py::handle index, py::handle dst, py::handle stream) {
        const char* op = "gather_rows";
        TensorRef src_ref = tensor_arg(src, op, "src", false);
        TensorRef index_ref = tensor_arg(index, op, "index", false);
        TensorRef dst_ref = tensor_arg(dst, op, "dst", true);
        std::uintptr_t stream_handle = stream_arg(stream);
        py::gil_scoped_release release;
        gather_rows(src_ref, index_ref, dst_ref, stream_handle);
      },
      py::arg("src"), py::arg("index"), py::arg("dst"), py::arg("stream") = 0,
      R"doc(dst[b] = src[b, index[b]] (one row per request, e.g. the MTP hidden state at
the last accepted position).

src T[B, M, ...], index int64[B] in 0..M-1, dst T[B, ...]. Any dtype T, copied
bitwise. An index outside 0..M-1 raises ValueError on the CPU (nothing written);
on CUDA that row of dst is left unchanged and check_device_errors() raises.)doc");

  module.def(
      "advance_decode_inputs",
      [](py::handle tokens, py::handle ids, py::handle positions, std::int64_t last_position,
         py::handle stream) {
        const char* op = "advance_decode_inputs";
        TensorRef tokens_ref = tensor_arg(tokens, op, "tokens", false);
        TensorRef ids_ref = tensor_arg(ids, op, "ids", true);
        TensorRef positions_ref = tensor_arg(positions, op, "positions", true);
        std::uintptr_t stream_handle = stream_arg(stream);
        py::gil_scoped_release release;
        advance_decode_inputs(tokens_ref, ids_ref, positions_ref, last_position, stream_handle);
      },
      py::arg("tokens"), py::arg("ids"), py::arg("positions"), py::arg("last_position"),
      py::arg("stream") = 0,
      R"doc(The next decode step's inputs, made where they live (no host round trip):
ids[b] = tokens[b]; positions[b] = min(positions[b] + 1, last_position).

tokens, ids, positions int64[B, 1] on one device; last_position >= 0 (max_length - 1: a
finished row that keeps running stays parked inside the buffers).)doc");

  module.def(
      "advance_speculative_inputs",
      [](py::handle step_ids, py::handle ids, py::handle positions, py::handle verified, py::handle counts,
         std::int64_t last_start, py::handle stream) {
        const char* op = "advance_speculative_inputs";
        TensorRef step_ids_ref = tensor_arg(step_ids, op, "step_ids", false);
        TensorRef ids_ref = tensor_arg(ids, op, "ids", true);
        TensorRef positions_ref = tensor_arg(positions, op, "positions", true);
        TensorRef verified_ref = tensor_arg(verified, op, "verified", true);
        TensorRef counts_ref = tensor_arg(counts, op, "counts", true);
        std::uintptr_t stream_handle = stream_arg(stream);
        py::gil_scoped_release release;
        advance_speculative_inputs(step_ids_ref, ids_ref, positions_ref, verified_ref, counts_ref, last_start,
                                   stream_handle);
      },
      py::arg("step_ids"), py::arg("ids"), py::arg("positions"), py::arg("verified"), py::arg("counts"),
      py::arg("last_start"), py::arg("stream") = 0,
      R"doc(A speculative step's control without the host, from the step_ids [B, 2k+2] a
verify_mtp_k{k} run wrote (tokens g_0..g_k | accept length a | drafts d_1..d_k):
counts[b] = a + 1 and verified[b] = positions[b] (this step's commit: KV rows 0..a at the
positions it verified); then the next step's inputs in place: ids[b] = [g_a, d_1..d_k],
positions[b, j] = min(positions[b, 0] + a + 1, last_start) + j.

ids, positions, verified int64[B, k+1] (k >= 1), counts int64[B], all on one device;
last_start >= 0 (max_length - k - 1: a finished row that keeps running stays inside the
buffers). An a outside 0..k raises ValueError on the CPU (nothing written); on CUDA that
row's ids and positions are left unchanged, its count is 0, and check_device_errors() raises.)doc");

  // The commit of a transition-record verify (core/transition_kernels.h): every GDN layer of a
  // device in one call (one launch on CUDA), all validated before anything is written.
  module.def(
      "replay_transitions",
      [](const py::list& states, const py::list& keys, const py::list& values, const py::list& decay,
         const py::list& beta, py::handle counts, py::handle stream) {
        const char* op = "replay_transitions";
        for (const auto& [name, list] : {std::pair<const char*, const py::list*>{"keys", &keys}, {"values", &values},
                                         {"decay", &decay}, {"beta", &beta}}) {
          require_same_count(op, name, list->size(), "states", states.size());
        }
        std::vector<TransitionLayer> layers;
        for (std::size_t i = 0; i < states.size(); ++i) {
          layers.push_back({tensor_arg(states[i], op, "state", true), tensor_arg(keys[i], op, "keys", false),
                            tensor_arg(values[i], op, "values", false), tensor_arg(decay[i], op, "decay", false),
                            tensor_arg(beta[i], op, "beta", false)});
        }
        TensorRef counts_ref = tensor_arg(counts, op, "counts", false);
        std::uintptr_t stream_handle = stream_arg(stream);
        py::gil_scoped_release release;
        replay_transitions(layers, counts_ref, stream_handle);
      },
      py::arg("states"), py::arg("keys"), py::arg("values"), py::arg("decay"), py::arg("beta"), py::arg("counts"),
      py::arg("stream") = 0,
      R"doc(Replays each request's first counts[b] verify rows onto its GDN state, in place, for every layer.

Per layer l: states[l] float32[B, nv, dk, dv], keys[l] [B, M, nk, dk] (k̂), values[l] [B, M, nv*dv]
(or [B, M, nv, dv]), decay[l] and beta[l] [B, M, nv]; counts int64[B] in 0..M, one for all layers.
For each row j < counts[b] and value head h (key head h // (nv/nk)): S <- exp(g) S;
u = beta (v - S^T k); S <- S + k u^T (LinearAttention's gated_delta rule). Every layer alike, on one
device. A count outside 0..M raises ValueError on the CPU (nothing written); on CUDA that request's
states are left unchanged and check_device_errors() raises.)doc");

  module.def(
      "commit_conv_tails",
      [](const py::list& tails, const py::list& inputs, py::handle counts, py::handle stream) {
        const char* op = "commit_conv_tails";
        require_same_count(op, "inputs", inputs.size(), "tails", tails.size());
        std::vector<ConvTailLayer> layers;
        for (std::size_t i = 0; i < tails.size(); ++i) {
          layers.push_back({tensor_arg(tails[i], op, "tail", true), tensor_arg(inputs[i], op, "inputs", false)});
        }
        TensorRef counts_ref = tensor_arg(counts, op, "counts", false);
        std::uintptr_t stream_handle = stream_arg(stream);
        py::gil_scoped_release release;
        commit_conv_tails(layers, counts_ref, stream_handle);
      },
      py::arg("tails"), py::arg("inputs"), py::arg("counts"), py::arg("stream") = 0,
      R"doc(Each request's conv tail after its first counts[b] verify rows, in place, for every layer.

Per layer: tails[l] float32[B, K-1, C], inputs[l] [B, M, C] (the rows' pre-conv q, k, v); counts
int64[B] in 0..M. tail[b] <- rows n..n+K-2 of concat(tail[b], inputs[b]), n = counts[b]. Errors as
replay_transitions.)doc");

  module.def(
      "check_device_errors",
      [](int device_index, py::handle stream) {
        std::uintptr_t stream_handle = stream_arg(stream);
        if (cuda_device_count() == 0) return;  // nothing can have run on a device
        std::string error;
        {
          py::gil_scoped_release release;
          error = take_kernel_error(Device::cuda(device_index), stream_handle);
        }
        if (!error.empty()) throw std::invalid_argument(error);
      },
      py::arg("device_index") = 0, py::arg("stream") = 0,
      "Synchronizes stream and raises ValueError for the first index error a CUDA state "
      "kernel recorded on the device since the last call (then clears it). Call it at a sync "
      "point, outside graph capture. A no-op where no CUDA device exists.");
}

}  // namespace ortspec::python
