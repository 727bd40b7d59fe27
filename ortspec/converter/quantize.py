"""int4 weights for ONNX Runtime's MatMulNBits (block 32, symmetric, implicit zero point 8).

A weight W [K, N] (the [in, out] layout our MatMuls use) becomes
  B      uint8 [N, ceil(K/32), 16]   two 4-bit codes per byte, low nibble first, per output column
  scales float32 [N * ceil(K/32)]    one per block of 32 inputs: max|w| / 7
with w ≈ (code - 8) * scale. K is padded with zeros to a whole block.

The graphs use accuracy_level=4: ONNX Runtime's CPU kernel then quantizes activations per block
and accumulates in integers, so a row's result does not depend on how many rows share the call
(checked: the float path takes another kernel for one row than for several), which speculative
decoding's exactness needs.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32
QUANTIZED_SUFFIXES = (".qkv", ".o", ".in_proj", ".out", ".gate_up", ".down")
QUANTIZED_NAMES = ("lm_head", "mtp.fc", "mtp.lm_head")  # the embedding stays a gather table
DRAFT_HEAD_PREFIX = "mtp."


def quantize_int4(weight: np.ndarray, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """[K, N] float -> (B uint8 [N, blocks, block/2], scales float32 [N * blocks]). The graphs use
    block 32: with 64 or 128 ONNX Runtime 1.32's accuracy_level 4 kernel is ~20% faster per row but
    no longer gives a row the same bits at any M (tools/row_invariance.py)."""
    K, N = weight.shape
    blocks = -(-K // block)
    padded = np.zeros((blocks * block, N), np.float32)
    padded[:K] = weight
    w = padded.T.reshape(N, blocks, block)  # per output column, blocks along K
    scales = np.abs(w).max(axis=2) / 7.0  # [N, blocks]
    scales[scales == 0] = 1.0
    codes = np.clip(np.rint(w / scales[..., None]) + 8, 0, 15).astype(np.uint8)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)  # [N, blocks, 16]
    return packed, scales.astype(np.float32).reshape(-1)


def dequantize_int4(packed: np.ndarray, scales: np.ndarray, K: int) -> np.ndarray:
    """The [K, N] float weights an int4 weight stands for (tests and error reports)."""
    N, blocks, _ = packed.shape
    codes = np.empty((N, blocks, BLOCK), np.float32)
    codes[..., 0::2] = packed & 0x0F
    codes[..., 1::2] = packed >> 4
    w = (codes - 8) * scales.reshape(N, blocks)[..., None]
    return w.reshape(N, blocks * BLOCK)[:, :K].T


def quantize_store(store, prefix: str = "") -> None:
    """Replaces every projection matrix of the store (whose name starts with ``prefix``) by its
    int4 form (store.quantized[name] = (K, N))."""
    for name in list(store.arrays):
        if name.startswith(prefix) and (name in QUANTIZED_NAMES or name.endswith(QUANTIZED_SUFFIXES)):
            weight = store.arrays[name].astype(np.float32)
            packed, scales = quantize_int4(weight)
            store.arrays[name] = packed
            store.arrays[f"{name}.scales"] = scales
            store.quantized[name] = weight.shape


def quantize_draft_head(store) -> None:
    """int4 for the MTP head alone: its matrices and its own copy of the lm_head (``mtp.lm_head``;
    the target keeps its own). Drafts are proposals the target verifies, so this changes how
    often they are accepted, never the output; on the CPU a draft pass gets ~3x cheaper
    (BENCHMARKS.md, "the MTP head's cost per draft")."""
    store.add("mtp.lm_head", store.arrays["lm_head"])
    quantize_store(store, prefix=DRAFT_HEAD_PREFIX)
