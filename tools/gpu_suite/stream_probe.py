"""Can the host run ahead of the GPU? A feasibility probe for issue 11 (python3 tools/gpu.py stream_probe).

For each model (default: models/tiny-qwen35 in float32 and models/qwen35-python-20m in float16,
converted here), batch 1, greedy, after a warm-up that captures the CUDA graphs:

(a) the plain loop: ``Decoder.step``, as batchers run it (upload ids and positions, graph
    replay, ONNX Runtime's synchronisation at the end of Run, the argmax downloaded, states
    committed by the native kernels, Python bookkeeping). Before commit 9ce5aee the kernels ran on
    the legacy stream 0 with a synchronisation before every Run; since, on the stream shared
    with ONNX Runtime.
(b) the device loop: a second ONNX Runtime session of the same decode graph, on the same weights
    and state buffers, with provider options enable_cuda_graph=1 and user_compute_stream = an
    ortspec ``Stream``, run with disable_synchronize_execution_providers=1. Per step everything
    is enqueued on that one stream: positions uploaded (they are known: +1 per step), the graph
    replayed, the states committed by the native kernels, the argmax copied device to device
    into the next step's input_ids, and copied into page-locked memory behind an ``Event``. The
    host reads step n's token after enqueueing step n+1: a step late.
(c) as (b), but every Run synchronizes (ONNX Runtime's default): what the shared stream alone buys.
(d) ortspec's loop at depth 1 (``speculative/decoder.py``, what a CUDA generate call
    runs since commit f66d829; absent before): the runtime's own version of (b).

Prints, per model and loop: microseconds per step, tokens/s, host microseconds per step spent
enqueueing, the share of steps whose stream was still busy when Run returned (Run is then
asynchronous), and whether the tokens equal (a)'s. A provider or run option that ONNX Runtime
refuses ends that model's row with the error instead of raising. Exit status 1 when a loop that
ran gave other tokens than (a).
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

import ortspec
from ortspec.runtime.arrays import DTYPES
from ortspec.runtime.graph_slots import NO_SYNC
from ortspec.runtime.graphs import SharedWeights
from ortspec.runtime.states import Rows
from ortspec.speculative.decoder import Decoder
from ortspec.speculative.requests import Request
from ortspec.speculative.stats import Stats

from .common import STEP_PROMPT, TINY, TRAINED, convert, markdown_table, write_json

SUMMARY = "the plain greedy loop against back-to-back replays on an ortspec stream, fed device to device"
PRESETS = {"tiny": TINY, "trained": TRAINED}


def add_arguments(parser) -> None:
    parser.add_argument("--models", default="tiny:float32,trained:float16",
                        help="comma-separated PRESET:DTYPE (presets: tiny, trained) or converted model directories")
    parser.add_argument("--steps", type=int, default=256, help="timed steps per loop")
    parser.add_argument("--warmup", type=int, default=8, help="steps before timing (graph capture)")
    parser.add_argument("--out", default="/tmp/ortspec_stream_probe", help="working directory (converted models)")


def run(args) -> int:
    print("onnxruntime", ort.__version__)
    rows, results, failures = [], {}, 0
    for spec in args.models.split(","):
        model = prepare(spec, Path(args.out))
        result = probe_model(model, args.steps, args.warmup)
        results[spec] = result
        for loop, entry in result["loops"].items():
            failures += entry.get("tokens_equal") is False
            rows.append([spec, loop, *cells(entry)])
        if result.get("error"):
            rows.append([spec, "(b)/(c)", "refused", "-", "-", "-", result["error"][:160]])
        print(f"{spec}: probe session provider options: {result.get('provider_options')}")
    print()
    print(markdown_table(["model", "loop", "us/step", "tok/s", "host enqueue us/step",
                          "Run returned before the GPU was done", "tokens equal (a)"], rows))
    write_json(args.json, results)
    print("failures:", failures)
    return 1 if failures else 0


def cells(entry: dict) -> list:
    per_step = entry["seconds_per_step"]
    enqueue = entry.get("enqueue_seconds_per_step")
    busy = entry.get("busy_after_run")
    return [f"{1e6 * per_step:.0f}", f"{1 / per_step:.0f}", "-" if enqueue is None else f"{1e6 * enqueue:.0f}",
            "-" if busy is None else f"{busy:.0%}", {None: "reference", True: "yes", False: "NO"}[entry.get("tokens_equal")]]


def prepare(spec: str, out: Path) -> Path:
    """A converted model directory: PRESET:DTYPE is converted into out, a directory is used as it is."""
    name, _, dtype = spec.partition(":")
    if name not in PRESETS:
        return Path(spec)
    return convert(PRESETS[name], out / f"{name}_{dtype or 'float32'}", dtype=dtype or "float32", max_length=512)


def probe_model(model: Path, steps: int, warmup: int) -> dict:
    session = ortspec.Session(model, provider="cuda")
    total = warmup + steps
    tokens, per_step = plain_loop(session, total, warmup)
    result = {"loops": {"(a) plain loop": {"seconds_per_step": per_step, "tokens": tokens}}}
    if "pipelined" in inspect.signature(Decoder).parameters:
        piped, per_step = pipelined_loop(session, total, warmup)
        result["loops"]["(d) ortspec pipelined"] = {"seconds_per_step": per_step, "tokens": piped,
                                                     "tokens_equal": piped == tokens}
    native = session.graphs.arrays.native
    stream = native.Stream(session.graphs.arrays.device_index)
    try:
        with session.lease_engine(1) as engine:
            loop = DeviceLoop(session, engine, stream)
            result["provider_options"] = loop.provider_options
            for name, asynchronous in (("(b) device loop", True), ("(c) device loop, Run syncs", False)):
                entry = loop.measure(total, warmup, asynchronous)
                entry["tokens_equal"] = entry["tokens"] == tokens
                result["loops"][name] = entry
    except Exception as error:  # noqa: BLE001  (a refused option is this probe's answer, not a crash)
        result["error"] = f"{type(error).__name__}: {error}"
    finally:
        stream.synchronize()
        session.close()
    return result


def plain_loop(session, total: int, warmup: int) -> tuple[list[int], float]:
    """(the tokens after the prompt, seconds per timed step) of Decoder.step (the plain loop), greedy, batch 1."""
    with session.lease_engine(1) as engine:
        decoder = Decoder(session.graphs, 1, 0, "select", Stats(), engine=engine)
        request = Request(row=0, prompt=list(STEP_PROMPT), max_new_tokens=total + 2)
        decoder.admit([request])
        for _ in range(warmup):
            decoder.step()
        start = time.perf_counter()
        for _ in range(total - warmup):
            decoder.step()
        seconds = (time.perf_counter() - start) / (total - warmup)
        return request.output(), seconds


def pipelined_loop(session, total: int, warmup: int) -> tuple[list[int], float]:
    """(the tokens after the prompt, seconds per timed step) of the Decoder's pipelined loop."""
    with session.lease_engine(1) as engine:
        decoder = Decoder(session.graphs, 1, 0, "select", Stats(), engine=engine, pipelined=True)
        request = Request(row=0, prompt=list(STEP_PROMPT), max_new_tokens=total + 1)
        steps = decoder.steps([request])
        for _ in range(1 + warmup):  # the prefill, then the warm-up steps
            next(steps)
        start = time.perf_counter()
        for _ in range(total - warmup):
            next(steps)
        seconds = (time.perf_counter() - start) / (total - warmup)
        for _ in steps:  # nothing left: the request is done
            pass
        return request.output(), seconds


class DeviceLoop:
    """The decode graph of one engine in its own ONNX Runtime session on an ortspec stream,
    bound once over static buffers: the engine's states, input_ids, positions and the outputs."""

    def __init__(self, session, engine, stream) -> None:
        graphs, self.engine, self.stream = session.graphs, engine, stream
        self.arrays, self.native, manifest = graphs.arrays, graphs.arrays.native, graphs.manifest
        self.decoder = Decoder(graphs, 1, 0, "select", Stats(), engine=engine)  # prefills only
        self.weights = SharedWeights(manifest, self.arrays)  # a second copy: the probe leaves the runtime alone
        options = self.weights.session_options(manifest.graphs["decode"]["weights"], None)
        cuda = {"device_id": str(self.arrays.device_index), "use_tf32": "0", "enable_cuda_graph": "1",
                "user_compute_stream": str(stream.handle)}
        self.session = ort.InferenceSession(str(manifest.graph_path("decode")), options,
                                            providers=[("CUDAExecutionProvider", cuda)])
        self.provider_options = {k: v for k, v in self.session.get_provider_options().get(
            "CUDAExecutionProvider", {}).items() if k in ("has_user_compute_stream", "user_compute_stream",
                                                          "enable_cuda_graph")}
        self.ids = self.arrays.zeros((1, 1), np.int64)  # [B, 1] next step's input, written on the device
        self.positions = self.arrays.zeros((1, 1), np.int64)  # [B, 1]
        self.feeds = {"input_ids": self.ids, "positions": self.positions,
                      **engine.target.states.feeds(Rows([0]))}
        shapes = graphs["decode"].run_bound(self.feeds)  # ortspec's own eager run: the output shapes
        self.outputs = {name: self.arrays.zeros(value.shape, DTYPES[value.dtype]) for name, value in shapes.items()}
        self.binding = self.session.io_binding()
        for name in (i.name for i in self.session.get_inputs()):
            self.binding.bind_ortvalue_input(name, self.arrays.ort_value(self.feeds[name]))
        for name in (o.name for o in self.session.get_outputs()):
            self.binding.bind_ortvalue_output(name, self.arrays.ort_value(self.outputs[name]))
        self.host_tokens = [self.native.pinned_host_buffer((1, 1), "int64") for _ in range(2)]
        self.events = [self.native.Event(self.arrays.device_index) for _ in range(2)]

    def run_options(self, asynchronous: bool) -> ort.RunOptions:
        options = ort.RunOptions()
        options.add_run_config_entry("gpu_graph_id", "1")
        if asynchronous:
            options.add_run_config_entry(NO_SYNC, "1")
        return options

    def measure(self, total: int, warmup: int, asynchronous: bool) -> dict:
        """Prefills the prompt (ortspec's own path), then `total` steps of the device loop; the
        tokens and the per-step times of the steps after `warmup`."""
        request = Request(row=0, prompt=list(STEP_PROMPT), max_new_tokens=total + 2)
        self.decoder.admit([request])
        self.arrays.synchronize()  # the prefill's commits ran on the runtime's stream, which ours does not wait for
        options, handle = self.run_options(asynchronous), self.stream.handle
        self.ids.copy_from_numpy(np.array([[request.pending]], np.int64), stream=handle)
        tokens, enqueue, busy, start = [request.tokens[-1]], 0.0, 0, None
        for n in range(total):
            if n == warmup:
                self.stream.synchronize()
                start = time.perf_counter()
            began = time.perf_counter()
            busy += self.enqueue(n, request.processed + n, options) and n >= warmup
            enqueue += (time.perf_counter() - began) if n >= warmup else 0.0
            if n:
                tokens.append(self.read(n - 1))
        tokens.append(self.read(total - 1))
        seconds = time.perf_counter() - start
        timed = total - warmup
        return {"seconds_per_step": seconds / timed, "enqueue_seconds_per_step": enqueue / timed,
                "busy_after_run": busy / timed, "tokens": tokens}

    def enqueue(self, n: int, position: int, options) -> bool:
        """One step on the stream; returns whether the stream was still busy when Run returned."""
        handle, out = self.stream.handle, self.outputs
        self.positions.copy_from_numpy(np.array([[position]], np.int64), stream=handle)  # pageable: staged at once
        self.session.run_with_iobinding(self.binding, options)
        busy = not self.stream.idle()
        target = self.engine.target.states
        self.native.copy_buffers([layer.buffer for layer in target.layers],
                                 [out[layer.out_name] for layer in target.layers], stream=handle)
        for cache in target.caches:  # the new KV row at this step's position
            key, value = cache.names
            self.native.write_rows(cache.key, out["new_" + key], self.positions, None, axis=3, stream=handle)
            self.native.write_rows(cache.value, out["new_" + value], self.positions, None, axis=2, stream=handle)
        self.native.copy_buffer(self.ids, out["tokens"], stream=handle)  # next input, device to device
        self.native.copy_to_host(self.host_tokens[n % 2], out["tokens"], stream=handle)
        self.events[n % 2].record(handle)
        return busy

    def read(self, n: int) -> int:
        self.events[n % 2].synchronize()
        return int(self.host_tokens[n % 2].numpy()[0, 0])
