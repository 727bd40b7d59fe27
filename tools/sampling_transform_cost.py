"""What choosing a token costs on ONNX Runtime's CPU EP, apart from the model: the argmax (greedy),
the sampling transform and draw as the portable graphs build it for a decode (one ai.ortspec
SampleToken, ``fused``) and for a verify (the steps, with the ai.ortspec threshold and draw, ``native``),
with ONNX ops alone (a full sort and blocked cumulative sums, ``sort``) and as the CPU graphs do
(``candidates``), and the numpy reference (speculative.sampling), on random logits [B, 1, V].

    python3 tools/sampling_transform_cost.py --vocab 248320 --batch 1,4 --threads 1
    python3 tools/sampling_transform_cost.py --provider cuda --vocab 4096,248320 --batch 1,16,64

On CUDA each variant runs as a captured CUDA graph over device-bound inputs, as the sampling
graphs do in a step, and the variants are: the argmax, the decode's one op (fused), the portable
transform and draw in steps (native),
the same with ONNX ops alone (sort),
the head's draft choice (Softmax(z / T) and the draw, no truncation: ``tempered``), and two
cumulative sums over [B, 1, V] alone: ONNX Runtime's CumSum (``cumsum``) and the blocked one the
portable graphs use (``blocked``, sampling_graph.prefix_sums).

Per sampling configuration (temperature only, top-p, top-k, min-p) and batch: the median
milliseconds per call over --repeats calls, each variant timed in turn round by round.
--scale is the standard deviation of the logits: a random model's are nearly flat (a wide top-p
nucleus: the candidates fall back to sorting), a trained model's peaked (a narrow one).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import onnxruntime as ort  # noqa: E402
from onnx import TensorProto  # noqa: E402

from ortspec.converter.builder import CPU, PORTABLE, GraphBuilder, WeightStore  # noqa: E402
from ortspec.converter.sampling_graph import (CANDIDATES, NATIVE, SORT, RowParams, make_draw, make_sampling_probs,  # noqa: E402
                                             make_sampled_tokens, make_token_choice, prefix_sums)
from ortspec.speculative import sampling  # noqa: E402
from ortspec.runtime import custom_ops  # noqa: E402

F32, I64 = TensorProto.FLOAT, TensorProto.INT64
CONFIGS = {"temperature": dict(top_k=0, top_p=1.0, min_p=0.0), "top_p 0.95": dict(top_k=0, top_p=0.95, min_p=0.0),
           "top_k 50": dict(top_k=50, top_p=1.0, min_p=0.0), "min_p 0.05": dict(top_k=0, top_p=1.0, min_p=0.05),
           "top_k 50 top_p 0.9": dict(top_k=50, top_p=0.9, min_p=0.0)}


def token_graph(vocab: int, method: str | None, threads: int) -> ort.InferenceSession:
    """logits [B, 1, V] -> token [B, 1]: the argmax (method None) or a draw with that threshold search."""
    return cpu_session(choice_model(vocab, method), threads)


def choice_model(vocab: int, variant: str | None) -> bytes:
    """logits [B, 1, V] -> token [B, 1] (the argmax for variant None, a draw with that threshold
    search, or ``tempered``: the head's untruncated draw), or -> [B, 1, V] (``cumsum``, ``blocked``)."""
    g = GraphBuilder("choice", WeightStore(), CPU if variant == CANDIDATES else PORTABLE)
    logits = g.input("logits", F32, ["B", 1, vocab])
    if variant is None:
        g.output(g.op("ArgMax", [logits], axis=-1, keepdims=0), "token", I64, ["B", 1])
    elif variant in ("cumsum", "blocked"):
        sums = (g.op("CumSum", [logits, g.const(-1)]) if variant == "cumsum" else
                prefix_sums(g, logits, vocab, exclusive=False))
        g.output(sums, "sums", F32, ["B", 1, vocab])
    else:
        params, u = RowParams.inputs(g), g.input("uniforms", F32, ["B", 1])
        if variant == "tempered":
            token = make_token_choice(g, logits, params, u, vocab, truncated=False)[0]
        elif variant == "fused":
            token = make_sampled_tokens(g, logits, params, u, vocab)
        else:
            token = make_draw(g, make_sampling_probs(g, logits, params, vocab, variant), u, vocab, variant)
        g.output(token, "token", I64, ["B", 1])
    return g.build({}).SerializeToString()


def op_models(vocab: int) -> dict[str, bytes]:
    """(--ops) The sampling graphs' ops one by one over logits x [B, 1, V] (float32), each model
    with one output: what each costs alone."""
    def model(name, make, shape):
        g = GraphBuilder(name, WeightStore(), PORTABLE)
        x = g.input("logits", F32, ["B", 1, vocab])
        out, elem = make(g, x)
        g.output(out, "sums" if shape == "V" else "token", elem, ["B", 1, vocab if shape == "V" else 1])
        return g.build({}).SerializeToString()

    ops = {
        "ReduceMax": (lambda g, x: (g.op("ReduceMax", [x, g.const([-1])]), F32), "1"),
        "ReduceSum": (lambda g, x: (g.op("ReduceSum", [x, g.const([-1])]), F32), "1"),
        "Softmax": (lambda g, x: (g.op("Softmax", [x], axis=-1), F32), "V"),
        "Mul [B,1,1]": (lambda g, x: (g.op("Mul", [x, g.op("ReduceMax", [x, g.const([-1])])]), F32), "V"),
        "count <=": (lambda g, x: (g.op("ReduceSum", [g.op("Cast", [g.op("LessOrEqual", [x, g.const(0.0, "float32")])],
                                                             to=F32), g.const([-1])]), F32), "1"),
        "last positive": (lambda g, x: (g.op("ReduceMax", [g.op("Where", [
            g.op("Greater", [x, g.const(0.0, "float32")]), g.const(range(vocab), "float32"),
            g.const(0.0, "float32")]), g.const([-1])]), F32), "1"),
        "prefix_sums": (lambda g, x: (prefix_sums(g, x, vocab, exclusive=False), F32), "V"),
        "TopK(V)": (lambda g, x: (g.op("TopK", [x, g.const([vocab])], num_outputs=2, axis=-1)[0], F32), "V"),
        "ArgMax": (lambda g, x: (g.op("ArgMax", [x], axis=-1, keepdims=1), I64), "1"),
    }
    return {name: model(name.split()[0], make, shape) for name, (make, shape) in ops.items()}


def cpu_session(model: bytes, threads: int) -> ort.InferenceSession:
    options = custom_ops.session_options()
    options.intra_op_num_threads, options.log_severity_level = threads, 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model, options)


def cuda_call(model: bytes, feeds: dict):
    """A call of the model as a captured CUDA graph over inputs and outputs bound on the device
    (the first call captures it); each call waits for the GPU."""
    session = ort.InferenceSession(model, custom_ops.session_options(),
                                   providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])
    binding, held = session.io_binding(), []
    for i in session.get_inputs():
        held.append(ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(feeds[i.name]), "cuda", 0))
        binding.bind_ortvalue_input(i.name, held[-1])
    batch, vocab = feeds["logits"].shape[0], feeds["logits"].shape[2]
    for o in session.get_outputs():
        shape = [batch, 1] if o.name == "token" and len(o.shape) == 2 else [batch, 1, 1] if o.name == "token" else [
            batch, 1, vocab]
        dtype = np.int64 if o.type == "tensor(int64)" else np.float32
        held.append(ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, "cuda", 0))
        binding.bind_ortvalue_output(o.name, held[-1])

    def call(_feeds, session=session, binding=binding, held=held):
        session.run_with_iobinding(binding)
    return call


def numpy_choice(feeds: dict) -> np.ndarray:
    probs = sampling.transform(feeds["logits"][:, 0], feeds["temperature"].astype(np.float64), feeds["top_k"],
                               feeds["top_p"].astype(np.float64), feeds["min_p"].astype(np.float64))
    return sampling.draw(probs, feeds["uniforms"][:, 0])


def feeds_for(batch: int, vocab: int, scale: float, config: dict, rng) -> dict:
    return {"logits": rng.normal(0, scale, (batch, 1, vocab)).astype(np.float32),
            "temperature": np.full(batch, 0.8, np.float32), "top_k": np.full(batch, config["top_k"], np.int64),
            "top_p": np.full(batch, config["top_p"], np.float32), "min_p": np.full(batch, config["min_p"], np.float32),
            "uniforms": rng.random((batch, 1), dtype=np.float32)}


def measure(variants: dict, feeds: dict, repeats: int, clock=time.perf_counter) -> dict[str, float]:
    """Median ms per call of each variant, interleaved call by call (one warm-up call each)."""
    times = {name: [] for name in variants}
    for r in range(repeats + 1):
        for name, call in variants.items():
            start = clock()
            call(feeds)
            if r:
                times[name].append(1e3 * (clock() - start))
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", default="248320", help="comma-separated vocabulary sizes V")
    parser.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--ops", action="store_true", help="time the graphs' ops one by one instead (op_models)")
    parser.add_argument("--batch", default="1,4", help="comma-separated batch sizes")
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall: elapsed time; cpu: the process's CPU time (every thread's), which other "
                             "processes sharing the cores do not inflate")
    parser.add_argument("--scale", type=float, default=3.0, help="standard deviation of the random logits")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per variant")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of " + ", ".join(CONFIGS))
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for vocab in (int(v) for v in args.vocab.split(",")):
        names = ({"argmax": None, "fused": "fused", NATIVE: NATIVE, SORT: SORT, "tempered": "tempered",
                  "cumsum": "cumsum", "blocked": "blocked"}
                 if args.provider == "cuda" else
                 {"argmax": None, "fused": "fused", NATIVE: NATIVE, SORT: SORT, CANDIDATES: CANDIDATES})
        models = op_models(vocab) if args.ops else {name: choice_model(vocab, variant) for name, variant in names.items()}
        print(f"V={vocab} provider={args.provider} threads={args.threads} logits scale={args.scale}; ms per call "
              f"(median of {args.repeats}, {args.clock} time)")
        print(f"{'config':20s} {'batch':>5s} " + " ".join(f"{n:>10s}" for n in [*models, *(
            ["numpy"] if args.provider == "cpu" else [])]))
        if args.provider == "cpu":
            sessions = {name: cpu_session(model, args.threads) for name, model in models.items()}
        for name in args.configs.split(","):
            for batch in (int(b) for b in args.batch.split(",")):
                feeds = feeds_for(batch, vocab, args.scale, CONFIGS[name], rng)
                if args.provider == "cuda":  # a session per shape: a captured graph holds its shapes
                    variants = {n: cuda_call(model, feeds) for n, model in models.items()}
                    for call in variants.values():
                        call(feeds)  # captures the graph before the timed calls
                else:
                    variants = {n: (lambda feeds, s=s: s.run(None, {i.name: feeds[i.name] for i in s.get_inputs()}))
                                for n, s in sessions.items()}
                    variants["numpy"] = numpy_choice
                ms = measure(variants, feeds, args.repeats, clock)
                print(f"{name:20s} {batch:5d} " + " ".join(f"{ms[n]:10.3f}" for n in variants), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
