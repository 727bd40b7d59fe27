"""ONNX Runtime sessions over one shared copy of the weights.

weights.bin is read once; every graph's session receives the same buffers through
``SessionOptions.add_initializer`` (checked: the sessions then read the caller's memory,
no private copy), so a model with eleven graphs holds its weights once.
Sessions are created on first use: a Session with k=2 never builds the k=3 verify graph.
"""

from __future__ import annotations

import time

import numpy as np
import onnxruntime as ort

from ..errors import ProviderError
from ..manifest import Manifest

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


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


def make_arrays(manifest: Manifest, provider: str):
    from .arrays import CudaArrays, HostArrays

    if provider == "cpu":
        return HostArrays()
    state_bytes = sum(4 * int(np.prod(e["shape"][1:])) for e in manifest.states.values())
    return CudaArrays(scratch_bytes=64 * state_bytes + (64 << 20))


class SharedWeights:
    """weights.bin once: numpy views on the CPU, or one upload into native device buffers,
    wrapped in OrtValues that every session shares (no per-session copy)."""

    def __init__(self, manifest: Manifest, arrays) -> None:
        raw = np.fromfile(manifest.dir / "weights.bin", dtype=np.uint8)
        self._buffers, self._values = {}, {}
        for name, entry in manifest.weights.items():
            array = raw[entry["offset"]: entry["offset"] + entry["length"]].view(entry["dtype"]).reshape(entry["shape"])
            if arrays.device != "cpu":
                device_array = arrays.zeros(array.shape, array.dtype)
                arrays.upload(device_array, array)
                array = device_array
            self._buffers[name] = array  # keeps the memory alive as long as the sessions
            self._values[name] = arrays.ort_value(array)
        arrays.settle()
        self.nbytes = raw.nbytes

    def session_options(self, names: list[str], threads: int | None) -> ort.SessionOptions:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        if threads:
            options.intra_op_num_threads = threads
        for name in names:
            options.add_initializer(name, self._values[name])
        return options


class GraphRunner:
    """One graph of the manifest; ``run`` takes numpy feeds and returns the named outputs."""

    def __init__(self, manifest: Manifest, name: str, weights: SharedWeights, arrays, provider: str = "cpu",
                 threads: int | None = None) -> None:
        self.name, self.arrays = name, arrays
        path = manifest.graph_path(name)
        options = weights.session_options(manifest.graphs[name]["weights"], threads)
        providers = [check_provider(provider)]
        if provider == "cuda":
            providers = [(providers[0], {"device_id": str(arrays.device_index)})]
        self.session = ort.InferenceSession(str(path), options, providers=providers)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.seconds = 0.0
        self.runs = 0

    def run(self, feeds: dict) -> dict:
        """Runs with inputs given as numpy arrays or arrays of the backend; returns backend
        arrays (numpy on the CPU; on CUDA device buffers ONNX Runtime allocated, kept alive
        by the returned dict)."""
        start = time.perf_counter()
        self.arrays.settle()
        if self.arrays.device == "cpu":
            values = self.session.run(self.output_names, {n: feeds[n] for n in self.input_names})
            out = dict(zip(self.output_names, values))
        else:
            out = self._run_bound(feeds)
        self.seconds += time.perf_counter() - start
        self.runs += 1
        return out

    def _run_bound(self, feeds: dict) -> dict:
        binding = self.session.io_binding()
        for name in self.input_names:
            value = feeds[name]
            if isinstance(value, np.ndarray):
                binding.bind_cpu_input(name, value)
            else:
                binding.bind_ortvalue_input(name, self.arrays.ort_value(value))
        for name in self.output_names:
            binding.bind_output(name, "cuda", self.arrays.device_index)
        self.session.run_with_iobinding(binding)
        values = binding.get_outputs()
        out = _Outputs({name: self.arrays.wrap(v) for name, v in zip(self.output_names, values)})
        out.keep_alive = (binding, values)
        return out


class _Outputs(dict):
    """Graph outputs; holds the OrtValues whose device memory the wrapped buffers point into."""

    keep_alive = None


class GraphSet:
    """Lazily created GraphRunners keyed by graph name, over one arrays backend and one weight copy."""

    def __init__(self, manifest: Manifest, provider: str = "cpu", threads: int | None = None) -> None:
        check_provider(provider)
        self.manifest, self.provider, self.threads = manifest, provider, threads
        self.arrays = make_arrays(manifest, provider)
        self.weights = SharedWeights(manifest, self.arrays)
        self._runners: dict[str, GraphRunner] = {}

    def load(self, names) -> None:
        """Creates the sessions up front (a Session does this for the graphs it will use)."""
        for name in names:
            self[name]

    def __getitem__(self, name: str) -> GraphRunner:
        if name not in self._runners:
            self._runners[name] = GraphRunner(self.manifest, name, self.weights, self.arrays, self.provider,
                                              self.threads)
        return self._runners[name]
