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


class SharedWeights:
    """weights.bin as numpy views wrapped in OrtValues (no copies)."""

    def __init__(self, manifest: Manifest) -> None:
        raw = np.fromfile(manifest.dir / "weights.bin", dtype=np.uint8)
        self._values = {}
        for name, entry in manifest.weights.items():
            array = raw[entry["offset"]: entry["offset"] + entry["length"]].view(entry["dtype"]).reshape(entry["shape"])
            self._values[name] = ort.OrtValue.ortvalue_from_numpy(array)
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

    def __init__(self, manifest: Manifest, name: str, weights: SharedWeights, provider: str = "cpu",
                 threads: int | None = None) -> None:
        self.name = name
        path = manifest.graph_path(name)
        options = weights.session_options(manifest.graphs[name]["weights"], threads)
        self.session = ort.InferenceSession(str(path), options, providers=[check_provider(provider)])
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.seconds = 0.0
        self.runs = 0

    def run(self, feeds: dict[str, np.ndarray], outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        start = time.perf_counter()
        names = outputs or self.output_names
        values = self.session.run(names, {n: feeds[n] for n in self.input_names})
        self.seconds += time.perf_counter() - start
        self.runs += 1
        return dict(zip(names, values))


class GraphSet:
    """Lazily created GraphRunners keyed by graph name."""

    def __init__(self, manifest: Manifest, provider: str = "cpu", threads: int | None = None) -> None:
        check_provider(provider)
        self.manifest, self.provider, self.threads = manifest, provider, threads
        self.weights = SharedWeights(manifest)
        self._runners: dict[str, GraphRunner] = {}

    def load(self, names) -> None:
        """Creates the sessions up front (a Session does this for the graphs it will use)."""
        for name in names:
            self[name]

    def __getitem__(self, name: str) -> GraphRunner:
        if name not in self._runners:
            self._runners[name] = GraphRunner(self.manifest, name, self.weights, self.provider, self.threads)
        return self._runners[name]
