"""ortspec's ONNX Runtime custom ops (domain ``ai.ortspec``: SamplingThreshold and Draw, the
sampling graphs' top-k / top-p threshold and inverse-CDF draw in one kernel per row, on the CPU
and CUDA; csrc/core/sampling_ops.h). They live in the native module, which ONNX Runtime loads as
a custom-op library; every session that may run a converted graph registers them."""

from __future__ import annotations

import onnxruntime as ort

from .._native_loader import load_native


def register(options: ort.SessionOptions) -> ort.SessionOptions:
    """options with the ai.ortspec ops registered (the same options, returned for chaining)."""
    options.register_custom_ops_library(load_native().__file__)
    return options


def session_options() -> ort.SessionOptions:
    """New SessionOptions with the ops registered: for tools that build their own sessions."""
    return register(ort.SessionOptions())
