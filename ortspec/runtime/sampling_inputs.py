"""The per-row inputs of the graphs that sample on the device (``decode_sample``,
``verify_mtp_sample_k{k}``, ``mtp_sample_k{k}``): what each request's row samples with, and
the uniforms of one step. The speculative layer builds them from its requests
(``speculative.sampler.device_inputs``); the runtime only feeds them.

    temperature float32 [B]   0: a greedy row (its tokens are the argmax, bit for bit)
    top_k       int64   [B]   0: off
    top_p       float32 [B]   1: off
    min_p       float32 [B]   0: off
    uniforms    float32 [B, U] in [0, 1): U = 1 (decode_sample), 2k+1 (verify_mtp_sample_k{k}:
                              k acceptances, the emitted token, k drafts), k (mtp_sample_k{k})
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingInputs:
    """One step's sampling inputs for B rows (module docstring)."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    uniforms: np.ndarray

    def __post_init__(self) -> None:
        rows = len(self.temperature)
        for name, dtype in (("temperature", np.float32), ("top_k", np.int64), ("top_p", np.float32),
                            ("min_p", np.float32), ("uniforms", np.float32)):
            value = getattr(self, name)
            if value.dtype != dtype or len(value) != rows or value.ndim != (2 if name == "uniforms" else 1):
                raise ValueError(f"SamplingInputs.{name}: {value.dtype} {value.shape}, expected {np.dtype(dtype)} "
                                 f"[{rows}{', U' if name == 'uniforms' else ''}]")

    @property
    def samples(self) -> np.ndarray:
        """bool [B]: the rows that draw (temperature > 0)."""
        return self.temperature > 0

    def feeds(self) -> dict[str, np.ndarray]:
        """The graph inputs, by name."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
