"""The ai.ortspec sampling ops on CUDA against the CPU's (python3 tools/gpu.py sampling_ops).

SamplingThreshold, Draw and SampleToken (csrc/core/sampling_ops.h) sum in integers, so the CUDA
kernels must give the CPU reference's bits exactly: this runs the ops over random rows (distinct
and tied logits, top-k / top-p / both / neither, min-p, greedy rows, V = 4,096 and 248,320, 1 to
64 rows) on the CPU provider
and on CUDA, eagerly and as a captured CUDA graph on an ortspec stream (user_compute_stream), and
checks every output equal and that the kernels ran on that stream. Exit status 1 on a mismatch.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

import ortspec._native as native
from ortspec.converter.builder import ORTSPEC_DOMAIN
from ortspec.runtime import custom_ops

from .common import Checks, markdown_table, write_json

SUMMARY = "the ai.ortspec sampling ops on CUDA against the CPU's, bit for bit, eager and captured"
F32, I64 = TensorProto.FLOAT, TensorProto.INT64
OUTPUTS = (("threshold", F32), ("index", I64), ("token", I64))


def add_arguments(parser) -> None:
    parser.add_argument("--vocab", default="4096,248320", help="comma-separated vocabulary sizes")
    parser.add_argument("--rows", default="1x1,4x4,16x1,64x1", help="comma-separated BxN shapes")


def model() -> bytes:
    nodes = [helper.make_node("SamplingThreshold", ["z", "probs", "top_k", "top_p"], ["threshold"], domain=ORTSPEC_DOMAIN),
             helper.make_node("Draw", ["probs", "u"], ["index"], domain=ORTSPEC_DOMAIN),
             helper.make_node("SampleToken", ["z", "greedy", "temperature", "top_k", "top_p", "min_p", "u"], ["token"],
                              domain=ORTSPEC_DOMAIN)]
    inputs = [helper.make_tensor_value_info(n, t, None) for n, t in
              (("z", F32), ("probs", F32), ("top_k", I64), ("top_p", F32), ("u", F32), ("greedy", I64),
               ("temperature", F32), ("min_p", F32))]
    outputs = [helper.make_tensor_value_info(name, t, None) for name, t in OUTPUTS]
    graph = helper.make_graph(nodes, "sampling_ops", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(ORTSPEC_DOMAIN, 1)],
                             ir_version=10).SerializeToString()


def feeds(rng, B: int, N: int, V: int, tied: bool) -> dict:
    z = rng.normal(0, 3, (B, N, V))
    z = (np.round(z * 2) / 2 if tied else z).astype(np.float32)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    # (top_k, top_p, temperature, min_p): SampleToken reads the last two, the other ops z as given
    settings = [(0, 0.95, 0.8, 0.0), (50, 1.0, 1.0, 0.0), (40, 0.8, 0.0, 0.0), (0, 1.0, 1.3, 0.0), (1, 0.5, 0.7, 0.0),
                (V, 0.999, 1.0, 0.05), (0, 1.0, 0.9, 0.01)]
    top_k, top_p, temperature, min_p = zip(*(settings[b % len(settings)] for b in range(B)))
    return {"z": z, "probs": (e / e.sum(axis=-1, keepdims=True)).astype(np.float32),
            "top_k": np.array(top_k, np.int64), "top_p": np.array(top_p, np.float32),
            "u": rng.random((B, N)).astype(np.float32), "greedy": z.argmax(-1),
            "temperature": np.array(temperature, np.float32), "min_p": np.array(min_p, np.float32)}


def captured(session_model: bytes, inputs: dict, stream) -> tuple[list, int]:
    """Both ops as a captured CUDA graph on `stream`: bound device inputs and outputs, one capture
    run, then a replay over changed inputs (the replay's outputs are returned)."""
    options = {"enable_cuda_graph": "1", "user_compute_stream": str(stream.handle)}
    session = ort.InferenceSession(session_model, custom_ops.session_options(),
                                   providers=[("CUDAExecutionProvider", options)])
    binding, held = session.io_binding(), {}
    for name, value in inputs.items():
        held[name] = ort.OrtValue.ortvalue_from_numpy(value, "cuda", 0)
        binding.bind_ortvalue_input(name, held[name])
    B, N, _ = inputs["z"].shape
    outputs = {"threshold": ort.OrtValue.ortvalue_from_shape_and_type([B, N, 1], np.float32, "cuda", 0),
               "index": ort.OrtValue.ortvalue_from_shape_and_type([B, N], np.int64, "cuda", 0),
               "token": ort.OrtValue.ortvalue_from_shape_and_type([B, N], np.int64, "cuda", 0)}
    for name, value in outputs.items():
        binding.bind_ortvalue_output(name, value)
    session.run_with_iobinding(binding)  # runs and captures
    session.run_with_iobinding(binding)  # replays
    return [outputs[name].numpy() for name, _ in OUTPUTS], native.last_custom_op_stream()


def run(args) -> int:
    checks, rows, results = Checks(), [], []
    graph = model()
    cpu = ort.InferenceSession(graph, custom_ops.session_options(), providers=["CPUExecutionProvider"])
    eager = ort.InferenceSession(graph, custom_ops.session_options(), providers=["CUDAExecutionProvider"])
    stream = native.Stream(0)
    rng = np.random.default_rng(0)
    for vocab in (int(v) for v in args.vocab.split(",")):
        for shape in args.rows.split(","):
            B, N = (int(x) for x in shape.split("x"))
            for tied in (False, True):
                inputs = feeds(rng, B, N, vocab, tied)
                want = cpu.run(None, inputs)
                got_eager = eager.run(None, inputs)
                got_graph, seen = captured(graph, inputs, stream)
                equal = [np.array_equal(a, b) and np.array_equal(a, c) for a, b, c in zip(want, got_eager, got_graph)]
                same = all(equal)
                if not same:
                    print(f"  differ: {[name for (name, _), e in zip(OUTPUTS, equal) if not e]}", flush=True)
                on_stream = seen == stream.handle
                label = f"V={vocab} {B}x{N} {'tied' if tied else 'distinct'}"
                checks.record(f"{label}: CUDA == CPU (eager, captured)", same)
                checks.record(f"{label}: the captured kernels ran on the session's stream", on_stream)
                rows.append([vocab, f"{B}x{N}", "tied" if tied else "distinct", "yes" if same else "NO",
                             "yes" if on_stream else "NO"])
                results.append(dict(vocab=vocab, batch=B, rows=N, tied=tied, equal=same, on_stream=on_stream))
                print(rows[-1], flush=True)
    write_json(args.json, {"cases": results})
    print(markdown_table(["V", "B x N", "logits", "CUDA == CPU", "on the stream"], rows))
    return checks.exit_status()
