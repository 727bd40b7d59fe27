"""ONNX Runtime sessions over one shared copy of the weights.

weights.bin is read once; every graph's session receives the same buffers through
``SessionOptions.add_initializer`` (checked: the sessions then read the caller's memory,
no private copy), so a model with eleven graphs holds its weights once.
Sessions are created on first use: a Session with k=2 never builds the k=3 verify graph.
"""

from __future__ import annotations

import contextlib
import threading

import ml_dtypes
import numpy as np
import onnxruntime as ort

from ..errors import ClosedError, ModelDirError, ProviderError
from ..manifest import Manifest, state_bytes
from . import custom_ops
from .fair_lock import FairLock
from .graph_slots import GraphSlots, Outputs, SlotKey, graph_id_options, is_captured_graph
from .host_binding import HostBinding
from .kv_window import KVWindows

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
NO_SPINNING = "session.intra_op.allow_spinning"  # ONNX Runtime session config key; "0": workers sleep when idle
_LOAD_FAILURES = tuple(getattr(ort.capi.onnxruntime_pybind11_state, name) for name in (
    "InvalidProtobuf", "InvalidGraph", "NoSuchFile", "Fail"))  # what ONNX Runtime raises for a bad model file


def check_provider(provider: str) -> str:
    if provider not in PROVIDERS:
        raise ProviderError(f"provider {provider!r} is unknown; use one of {sorted(PROVIDERS)}.")
    name = PROVIDERS[provider]
    if name not in ort.get_available_providers():
        raise ProviderError(
            f"provider {provider!r} needs {name}, which this onnxruntime ({ort.__version__}) lacks. "
            "For CUDA: pip uninstall onnxruntime && pip install onnxruntime-gpu (never both)."
        )
    return name


def make_arrays(manifest: Manifest, provider: str, device: int = 0):
    from .arrays import CudaArrays, HostArrays

    if provider == "cpu":
        return HostArrays(device)
    return CudaArrays(scratch_bytes=64 * state_bytes(manifest.states) + (64 << 20), device_index=device)


class SharedWeights:
    """weights.bin once per device: numpy views on the CPU, or native device buffers on CUDA,
    wrapped in OrtValues that every session on that device shares (no per-session copy).
    On CUDA a weight is uploaded when the first session that needs it is created, so a
    pipeline stage's device holds its own layers' weights only."""

    def __init__(self, manifest: Manifest, arrays) -> None:
        self.manifest, self.arrays = manifest, arrays
        path = manifest.dir / "weights.bin"
        try:
            self._raw = np.fromfile(path, dtype=np.uint8) if arrays.device == "cpu" else np.memmap(path, np.uint8, "r")
        except (OSError, ValueError) as exc:  # ValueError: np.memmap of an empty file
            raise ModelDirError(f"cannot read {path} ({exc}); run `ortspec verify {manifest.dir}`, then copy the "
                                "model again or reconvert it.") from exc
        self._buffers, self._values = {}, {}
        self.nbytes = 0  # bytes this device holds

    def _value(self, name: str) -> ort.OrtValue | None:
        if name not in self._values:
            entry = self.manifest.weights[name]
            dtype = ml_dtypes.bfloat16 if entry["dtype"] == "bfloat16" else entry["dtype"]
            raw = self._raw[entry["offset"]: entry["offset"] + entry["length"]]
            if raw.size != entry["length"]:  # Manifest.load checked the size; the file changed since
                raise ModelDirError(f"weight {name!r} lies past the end of {self.manifest.dir}/weights.bin "
                                    f"({self._raw.size} bytes); the file changed after loading. Reload the model.")
            array = raw.view(dtype).reshape(entry["shape"])
            if self.arrays.device != "cpu":
                if array.dtype == np.uint8:  # int4 blocks: the native buffers hold no uint8; each
                    return None  # session reads these (small) from weights.bin itself
                device_array = self.arrays.zeros(array.shape, array.dtype)
                self.arrays.upload(device_array, np.ascontiguousarray(array))
                array = device_array
            self._buffers[name] = array  # keeps the memory alive as long as the sessions
            self._values[name] = self.arrays.ort_value(array)
            self.nbytes += entry["length"]
        return self._values[name]

    def session_options(self, names: list[str], threads: int | None) -> ort.SessionOptions:
        """Options of one graph's session: these weights as shared initializers, ``threads``
        intra-op threads. On the CPU the thread pools do not spin: a speculative step alternates
        between the verify and the MTP sessions, and a pool left spinning after its Run takes the
        cores the other session's Run needs (docs/history.md, "Spinning thread pools"). On CUDA
        (threads unset) one: a graph's CPU nodes there are shape arithmetic, and a pool per session,
        a thread per core spinning after each Run, kept 2-4 cores busy under auto k's sessions."""
        options = custom_ops.session_options()  # the sampling graphs' ai.ortspec ops
        options.log_severity_level = 3
        if threads or self.arrays.device != "cpu":
            options.intra_op_num_threads = threads or 1
        if self.arrays.device == "cpu":
            options.add_session_config_entry(NO_SPINNING, "0")
        for name in names:
            if name in self.manifest.weights and self._value(name) is not None:
                options.add_initializer(name, self._values[name])
        self.arrays.synchronize()  # the uploads are done before the new session reads them (off the stream)
        return options


class GraphRunner:
    """One graph of the manifest, in its own ONNX Runtime session.

    ``run(feeds)`` runs it eagerly. ``run(feeds, slot=key)`` (CUDA graphs enabled) replays the
    captured CUDA graph of that slot (``graph_slots.GraphSlots``): the slot's numpy inputs are
    uploaded into static buffers, its buffer inputs must be the same buffers every time (else
    it runs eagerly and counts a fallback), and its outputs are static buffers that the next
    replay of the slot overwrites. Each session has its own CUDA memory arena, so the verify
    graph (the "verify sibling") never shares scratch with the M=1 decode. On the CPU ``run``
    may be called from several threads at once (ONNX Runtime's Run is thread-safe).
    """

    def __init__(self, manifest: Manifest, name: str, weights: SharedWeights, arrays, provider: str = "cpu",
                 threads: int | None = None, cuda_graphs: bool = False, slots: GraphSlots | None = None) -> None:
        self.name, self.arrays, self.slots = name, arrays, slots
        self.cuda_graphs = cuda_graphs and provider == "cuda"
        entry = manifest.graph_entry(name, provider)  # the CPU variant on the CPU, where the model has one
        path = manifest.dir / entry["file"]
        options = weights.session_options(entry["weights"], threads)
        providers = [check_provider(provider)]
        if provider == "cuda":
            # use_tf32=0: fp32 graphs compute in fp32 (TF32 would make M=1 and M=k+1 differ far more)
            cuda_options = {"device_id": str(arrays.device_index), "use_tf32": "0"}
            if self.cuda_graphs:
                cuda_options["enable_cuda_graph"] = "1"
            if arrays.shared_stream:  # ONNX Runtime's work and our kernels in one order (arrays.py)
                cuda_options["user_compute_stream"] = str(arrays.stream)
            providers = [(providers[0], cuda_options)]
        try:
            self.session = ort.InferenceSession(str(path), options, providers=providers)
        except _LOAD_FAILURES as exc:
            raise ModelDirError(
                f"ONNX Runtime cannot load graph {path.name} of {manifest.dir} ({type(exc).__name__}: "
                f"{str(exc)[:300]}). Run `ortspec verify {manifest.dir}` to find a damaged file, then copy the "
                "model again or reconvert it.") from exc
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self._eager_options = {wait: graph_id_options(-1 if self.cuda_graphs else None, wait) for wait in (True, False)}

    def run(self, feeds: dict, slot: SlotKey | HostBinding | None = None, wait: bool = True) -> dict:
        """Inputs as numpy arrays or backend arrays; returns backend arrays (numpy on the CPU;
        device buffers on CUDA, kept alive by the returned dict). On the CPU ``slot`` may be a
        ``HostBinding`` over the feeds' buffers (``TargetModel.bound_forward``). wait=False (a
        captured slot on the shared stream): Run returns once the replay is enqueued, before the
        GPU is done; the caller reads the outputs only through the stream (``GraphSlots.run``)."""
        if self.arrays.device == "cpu":
            if isinstance(slot, HostBinding):  # the CPU's slot: an IOBinding over the feeds' buffers
                return slot.run(feeds)
            values = self.session.run(self.output_names, {n: feeds[n] for n in self.input_names})
            return dict(zip(self.output_names, values))
        if slot is not None and self.cuda_graphs:
            return self.slots.run(self, slot, feeds, wait)
        return self.run_bound(feeds, wait)

    def run_bound(self, feeds: dict, wait: bool = True) -> dict:
        """One eager run over IOBinding (CUDA): inputs bound where they are, outputs allocated by ONNX
        Runtime. wait=False (the shared stream): Run returns once its work is enqueued, and what
        reads its outputs comes after it on the stream (a host read waits for it)."""
        self.arrays.settle()  # our kernels' writes land before ONNX Runtime reads (replay settles after its uploads)
        binding = self.session.io_binding()
        for name in self.input_names:
            value = feeds[name]
            if isinstance(value, np.ndarray):
                binding.bind_cpu_input(name, value)
            else:
                binding.bind_ortvalue_input(name, self.arrays.ort_value(value))
        for name in self.output_names:
            binding.bind_output(name, "cuda", self.arrays.device_index)
        self.session.run_with_iobinding(binding, self._eager_options[wait or not self.arrays.shared_stream])
        values = binding.get_outputs()
        out = Outputs({name: self.arrays.wrap(v) for name, v in zip(self.output_names, values)})
        out.keep_alive = (binding, values)
        return out


CUDA_LOCK = FairLock()
"""The one lock of every CUDA GraphSet in the process. ONNX Runtime captures a CUDA graph in the
global capture mode, during which no thread may synchronize, allocate or free on the device: a
second Session's prefill in another thread failed on the H200 with "operation not permitted when
stream is capturing" while the first captured. So CUDA work of different Sessions must not overlap
either, not only the steps of one Session's engines."""


def lock_for(provider: str):
    """CUDA: the process-wide CUDA_LOCK; CPU: a lock of the GraphSet's own, guarding only the lazy
    creation of its sessions and weights (re-entered: __getitem__ -> _place)."""
    return CUDA_LOCK if provider == "cuda" else threading.RLock()


class GraphSet:
    """Lazily created GraphRunners keyed by graph name, each on its device with that device's
    weights and arrays. A KV window variant (decode.w256: ``kv_window``) is a graph of its own
    name, so its own session, created on first use like the others.

    devices: the device of each pipeline stage (default: everything on device 0). Stage s's
    graphs and its layers' states live on devices[s]; the MTP head, and so the tokens and the
    final hidden state it reads, live with the last stage. ``arrays`` is that last device's.

    Threads: ``device_lock`` is held for a step, a prefill or an allocation. On CUDA it is a real
    lock, granted in arrival order (``FairLock``), and the same for every CUDA GraphSet of the
    process (``CUDA_LOCK``), because every engine shares the device's scratch arena (reset by
    ``begin_step``), the one stream our kernels and the uploads run on, the buffer pool, and ONNX
    Runtime's graph capture (no other CUDA work of the process may run meanwhile); so steps of
    different callers, of one Session or of several, take turns one by one and never overlap. On the CPU it is a
    no-op: calls on different engines run in parallel (ONNX Runtime's Run is thread-safe,
    HostArrays keeps no shared state), and only the lazy creation of sessions and per-device
    weights is guarded.
    """

    def __init__(self, manifest: Manifest, provider: str = "cpu", threads: int | None = None,
                 cuda_graphs: bool = True, devices: list[int] | None = None) -> None:
        check_provider(provider)
        self.manifest, self.provider, self.threads = manifest, provider, threads
        self.cuda_graphs = cuda_graphs and provider == "cuda"
        self.devices = list(devices) if devices else [0]
        self._lock = lock_for(provider)
        self.device_lock = self._lock if provider == "cuda" else contextlib.nullcontext()
        self._closed = False
        self._placed: dict[int, tuple] = {}  # device -> (arrays, SharedWeights)
        self.arrays = self.arrays_on(self.devices[-1])
        self.slots = GraphSlots(self.arrays.native.GraphSlotRegistry() if provider == "cuda" else None)
        self.kv_windows = KVWindows(manifest, variants=provider == "cuda", host_buffers=provider != "cuda")  # CPU views or CUDA window variants
        self._runners: dict[str, GraphRunner] = {}

    def _place(self, device: int) -> tuple:
        with self._lock:
            self._check_open()
            if device not in self._placed:
                arrays = make_arrays(self.manifest, self.provider, device)
                if self.provider == "cpu" and self._placed:  # host memory: one copy serves every "device"
                    weights = next(iter(self._placed.values()))[1]
                else:
                    weights = SharedWeights(self.manifest, arrays)
                self._placed[device] = (arrays, weights)
            return self._placed[device]

    def arrays_on(self, device: int):
        return self._place(device)[0]

    def stage_device(self, stage: int) -> int:
        return self.devices[stage] if len(self.devices) > 1 else self.devices[0]

    def graph_device(self, name: str) -> int:
        if name in ("mtp", "sample_logits") or name.startswith("mtp_"):  # they read the last stage's outputs
            return self.devices[-1]
        return self.stage_device(int(name.rsplit(".stage", 1)[1]) if ".stage" in name else 0)

    def state_arrays(self, name: str):
        """The arrays of the device that holds this state: its layer's stage, or the last for the MTP head's."""
        layer = self.manifest.states[name]["layer"]
        if layer == "mtp" or len(self.devices) == 1:
            return self.arrays_on(self.devices[-1] if layer == "mtp" else self.devices[0])
        bounds = self.manifest.stage_layers
        stage = next(s for s in range(len(bounds) - 1) if bounds[s] <= layer < bounds[s + 1])
        return self.arrays_on(self.stage_device(stage))

    def begin_step(self, check_errors: bool = True) -> None:
        """(under device_lock) Hands every device's step scratch back, after reporting any index
        error a kernel recorded (which waits for the GPU; ``CudaArrays.begin_step``)."""
        for arrays, _ in list(self._placed.values()):  # a copy: another thread may place a device meanwhile
            arrays.begin_step(check_errors)

    @property
    def weight_bytes(self) -> dict[int, int]:
        """Weight bytes held per device."""
        return {device: weights.nbytes for device, (_, weights) in self._placed.items()}

    def load(self, names) -> None:
        """Creates the sessions up front (a Session does this for the graphs it will use)."""
        for name in names:
            self[name]

    def graph_counters(self) -> dict:
        """Per CUDA-graph slot: captures, replays, fallbacks, invalidations ({} on the CPU)."""
        return self.slots.counters()

    def __getitem__(self, name: str) -> GraphRunner:
        runner = self._runners.get(name)
        if runner is None:
            with self._lock:
                self._check_open()
                if name not in self._runners:
                    arrays, weights = self._place(self.graph_device(name))
                    self._runners[name] = GraphRunner(self.manifest, name, weights, arrays, self.provider,
                                                      self.threads, self.cuda_graphs and is_captured_graph(name),
                                                      self.slots)
                runner = self._runners[name]
        return runner

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Releases the captured slots, the ONNX Runtime sessions (and with them their CUDA graphs),
        and every device's buffers and weights. Later use raises ClosedError. Idempotent."""
        with self._lock:
            for arrays, _ in self._placed.values():  # nothing queued on the shared stream may outlive
                arrays.synchronize()                 # the sessions' memory it reads
            self.slots.release()
            self._runners.clear()
            for arrays, _ in self._placed.values():
                arrays.release()
            self._placed.clear()
            self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"the graphs of {self.manifest.dir} were released (Session.close()); "
                              "open a new Session to run them.")
