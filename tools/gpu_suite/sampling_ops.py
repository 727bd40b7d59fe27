"""The ai.ortspec sampling ops on CUDA against the CPU's (python3 tools/gpu.py sampling_ops).

SamplingThreshold, Draw, SampleToken, TransformRows and SpeculativeAccept
(csrc/core/sampling_ops.h) sum in integers, so the CUDA kernels must give the CPU reference's bits
exactly: this runs the ops over random rows (distinct and tied logits, top-k / top-p / both /
neither, min-p, greedy rows, V = 4,096 and 248,320, 1 to 64 rows; the acceptance where a request
has N >= 2 rows, k = N - 1 drafts) on the CPU provider
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
ACCEPT_OUTPUTS = (("stats", I64), ("accepted", I64), ("emitted", I64))


def add_arguments(parser) -> None:
    parser.add_argument("--vocab", default="4096,248320", help="comma-separated vocabulary sizes")
    parser.add_argument("--rows", default="1x1,4x4,16x1,64x1,16x4", help="comma-separated BxN shapes")


def model() -> bytes:
    nodes = [helper.make_node("SamplingThreshold", ["z", "probs", "top_k", "top_p"], ["threshold"], domain=ORTSPEC_DOMAIN),
             helper.make_node("Draw", ["probs", "u"], ["index"], domain=ORTSPEC_DOMAIN),
             helper.make_node("SampleToken", ["z", "greedy", "temperature", "top_k", "top_p", "min_p", "u"], ["token"],
                              domain=ORTSPEC_DOMAIN)]
    inputs = [helper.make_tensor_value_info(n, t, None) for n, t in
              (("z", F32), ("probs", F32), ("top_k", I64), ("top_p", F32), ("u", F32), ("greedy", I64),
               ("temperature", F32), ("min_p", F32))]
    return serialized(nodes, inputs, OUTPUTS)


def accept_model() -> bytes:
    """stats = TransformRows(z, ...), (accepted, emitted) = SpeculativeAccept(z, stats, ...): z as
    the verify's logits [B, k+1, V]."""
    nodes = [helper.make_node("TransformRows", ["z", "temperature", "top_k", "top_p", "min_p"], ["stats"],
                              domain=ORTSPEC_DOMAIN),
             helper.make_node("SpeculativeAccept", ["z", "stats", "drafts", "q", "temperature", "min_p", "u",
                                                    "greedy_accepted", "greedy_token"], ["accepted", "emitted"],
                              domain=ORTSPEC_DOMAIN)]
    inputs = [helper.make_tensor_value_info(n, t, None) for n, t in
              (("z", F32), ("temperature", F32), ("top_k", I64), ("top_p", F32), ("min_p", F32), ("drafts", I64),
               ("q", F32), ("u", F32), ("greedy_accepted", I64), ("greedy_token", I64))]
    return serialized(nodes, inputs, ACCEPT_OUTPUTS)


def serialized(nodes, inputs, outputs) -> bytes:
    graph = helper.make_graph(nodes, "sampling_ops", inputs,
                              [helper.make_tensor_value_info(name, t, None) for name, t in outputs])
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


def accept_feeds(rng, base: dict) -> dict:
    """SpeculativeAccept's inputs over feeds()' rows: drafts half the row's argmax (often
    accepted), half random, q a random distribution per draft, greedy values to pass through."""
    z = base["z"]
    B, N, V = z.shape
    drafts = np.where(rng.random((B, N - 1)) < 0.5, z[:, :-1].argmax(-1), rng.integers(0, V, (B, N - 1)))
    q = rng.random((B, N - 1, V)).astype(np.float32) ** 4
    return {**{n: base[n] for n in ("z", "temperature", "top_k", "top_p", "min_p", "u")}, "drafts": drafts,
            "q": (q / q.sum(-1, keepdims=True)).astype(np.float32),
            "greedy_accepted": rng.integers(0, N, B), "greedy_token": rng.integers(0, V, B)}


def captured(session_model: bytes, inputs: dict, stream, shapes: dict) -> tuple[list, int]:
    """Both ops as a captured CUDA graph on `stream`: bound device inputs and outputs, one capture
    run, then a replay over changed inputs (the replay's outputs are returned)."""
    options = {"enable_cuda_graph": "1", "user_compute_stream": str(stream.handle)}
    session = ort.InferenceSession(session_model, custom_ops.session_options(),
                                   providers=[("CUDAExecutionProvider", options)])
    binding, held = session.io_binding(), {}
    for name, value in inputs.items():
        held[name] = ort.OrtValue.ortvalue_from_numpy(value, "cuda", 0)
        binding.bind_ortvalue_input(name, held[name])
    outputs = {name: ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, "cuda", 0)
               for name, (shape, dtype) in shapes.items()}
    for name, value in outputs.items():
        binding.bind_ortvalue_output(name, value)
    session.run_with_iobinding(binding)  # runs and captures
    session.run_with_iobinding(binding)  # replays
    return [outputs[name].numpy() for name in shapes], native.last_custom_op_stream()


def sessions(graph: bytes) -> tuple:
    return tuple(ort.InferenceSession(graph, custom_ops.session_options(), providers=[provider])
                 for provider in ("CPUExecutionProvider", "CUDAExecutionProvider"))


def compare(graph: bytes, pair: tuple, inputs: dict, stream, shapes: dict) -> tuple[bool, int]:
    """(every output equal on the CPU, eagerly on CUDA and captured; the captured run's stream)."""
    cpu, eager = pair
    want, got_eager = cpu.run(list(shapes), inputs), eager.run(list(shapes), inputs)
    got_graph, seen = captured(graph, inputs, stream, shapes)
    equal = [np.array_equal(a, b) and np.array_equal(a, c) for a, b, c in zip(want, got_eager, got_graph)]
    if not all(equal):
        print(f"  differ: {[name for name, e in zip(shapes, equal) if not e]}", flush=True)
    return all(equal), seen


def run(args) -> int:
    checks, rows, results = Checks(), [], []
    graphs = {"ops": model(), "accept": accept_model()}
    pairs = {name: sessions(graph) for name, graph in graphs.items()}
    stream = native.Stream(0)
    rng = np.random.default_rng(0)
    for vocab in (int(v) for v in args.vocab.split(",")):
        for shape in args.rows.split(","):
            B, N = (int(x) for x in shape.split("x"))
            for tied in (False, True):
                inputs = feeds(rng, B, N, vocab, tied)
                shapes = {"threshold": ([B, N, 1], np.float32), "index": ([B, N], np.int64),
                          "token": ([B, N], np.int64)}
                same, seen = compare(graphs["ops"], pairs["ops"], inputs, stream, shapes)
                if N >= 2:
                    accept_shapes = {"stats": ([B, N, 3], np.int64), "accepted": ([B], np.int64),
                                     "emitted": ([B], np.int64)}
                    accepted, seen_too = compare(graphs["accept"], pairs["accept"], accept_feeds(rng, inputs), stream,
                                                 accept_shapes)
                    same, seen = same and accepted, seen if seen == seen_too else -1
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
