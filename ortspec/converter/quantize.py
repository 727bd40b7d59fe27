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
QUANTIZED_NAMES = ("lm_head", "mtp.fc", "mtp.lm_head", "mtp.draft_head")  # the embedding stays a gather table
DRAFT_HEAD_PREFIX = "mtp."
_COLUMNS = 8192  # output columns quantized at once (quantize_int4)


def quantize_int4(weight: np.ndarray, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """[K, N] float -> (B uint8 [N, blocks, block/2], scales float32 [N * blocks]). The graphs use
    block 32: with 64 or 128 ONNX Runtime 1.32's accuracy_level 4 kernel is ~20% faster per row but
    no longer gives a row the same bits at any M (tools/row_invariance.py). Columns go _COLUMNS at a
    time, so the float temporaries stay small beside a 248k-column lm_head."""
    K, N = weight.shape
    blocks = -(-K // block)
    packed = np.empty((N, blocks, block // 2), np.uint8)
    scales = np.empty((N, blocks), np.float32)
    for start in range(0, N, _COLUMNS):
        columns = slice(start, min(N, start + _COLUMNS))
        packed[columns], scales[columns] = _quantize_columns(weight[:, columns], blocks, block)
    return packed, scales.reshape(-1)


def _quantize_columns(weight: np.ndarray, blocks: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """[K, n] -> (codes packed [n, blocks, block/2], scales [n, blocks])."""
    K, n = weight.shape
    padded = np.zeros((blocks * block, n), np.float32)
    padded[:K] = weight
    w = padded.T.reshape(n, blocks, block)  # per output column, blocks along K
    scales = np.abs(w).max(axis=2) / 7.0  # [n, blocks]
    scales[scales == 0] = 1.0
    codes = np.clip(np.rint(w / scales[..., None]) + 8, 0, 15).astype(np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), scales.astype(np.float32)


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
            weight = np.asarray(store.arrays[name], np.float32)  # no copy of a float32 matrix
            packed, scales = quantize_int4(weight)
            store.arrays[name] = packed
            store.arrays[f"{name}.scales"] = scales
            store.quantized[name] = weight.shape


def quantize_draft_head(store) -> None:
    """int4 for the MTP head alone: its matrices and its own copy of the lm_head (``mtp.lm_head``;
    the target keeps its own), or with a draft vocabulary its ``mtp.draft_head`` columns
    (converter/draft_vocab.py) instead of a copy. Drafts are proposals the target verifies, so
    this changes how often they are accepted, never the output; on the CPU a draft pass gets ~3x
    cheaper (BENCHMARKS.md, "the MTP head's cost per draft")."""
    if "mtp.draft_head" not in store.arrays:
        store.add("mtp.lm_head", store.arrays["lm_head"])
    quantize_store(store, prefix=DRAFT_HEAD_PREFIX)
