"""Shared fixtures: tiny random checkpoints made by tools/make_tiny_checkpoint.py, converted once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.make_tiny_checkpoint import make_checkpoint  # noqa: E402

import ortspec  # noqa: E402

# Configs exercised by parity and speculative tests: different layer orders, 1 and 2 KV heads,
# different head dims, GDN value heads > key heads and equal.
CONFIGS = {
    "base": dict(seed=1),
    "attn_first": dict(seed=2, layer_types=("full_attention", "linear_attention", "linear_attention"),
                       num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.5),
    "mixed": dict(seed=3, layer_types=("linear_attention", "full_attention", "linear_attention", "full_attention",
                                       "linear_attention"),
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
                  linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=16,
                  tie_word_embeddings=True),
}
MAX_LENGTH = 256
K = 4


class Models:
    def __init__(self, factory):
        self.factory = factory
        self._cache = {}

    def checkpoint(self, name: str) -> Path:
        key = ("ckpt", name)
        if key not in self._cache:
            path = self.factory.mktemp(f"ckpt_{name}")
            make_checkpoint(path, **CONFIGS[name])
            self._cache[key] = path
        return self._cache[key]

    def converted(self, name: str) -> Path:
        key = ("conv", name)
        if key not in self._cache:
            out = self.factory.mktemp(f"onnx_{name}")
            # the head in float32, not the default int4 for a float32 model: on these random tiny
            # weights an int4 head's drafts are rarely accepted, and the tests need accepted drafts
            # to reach every commit path (test_converter covers the default's head)
            ortspec.convert(self.checkpoint(name), out, num_speculative_tokens=K, max_length=MAX_LENGTH,
                            mtp_quant="none", progress=False)
            self._cache[key] = out
        return self._cache[key]


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> Models:
    return Models(tmp_path_factory)


@pytest.fixture(scope="session")
def tokenized_model(tmp_path_factory) -> Path:
    """A tiny checkpoint with a tokenizer.json, converted with K=3 and a short max_length=48
    (so the prompt-length errors are cheap to reach); for the Session API and error tests."""
    root = tmp_path_factory.mktemp("tokenized")
    make_checkpoint(root / "ck", seed=31, tokenizer=True)
    return ortspec.convert(root / "ck", root / "out", num_speculative_tokens=3, max_length=48, progress=False)


@pytest.fixture(scope="module")
def session(tokenized_model):
    """A Session over tokenized_model at k = 2, one per test module (the server, stop-string and
    openai-client tests); a module with a Session of its own defines its own ``session``."""
    with ortspec.Session(tokenized_model, num_speculative_tokens=2) as s:
        yield s


WINDOWED_MAX_LENGTH, WINDOWED_K = 320, 3  # past the smallest KV window (256): one variant per graph CUDA captures


@pytest.fixture(scope="session")
def windowed_model(models, tmp_path_factory) -> Path:
    """The "base" checkpoint converted with K=3 at max_length 320, so with the W = 256 KV window
    variants (converter/kv_windows.py) that max_length 256 conversions leave out."""
    out = tmp_path_factory.mktemp("kv_windows") / "model"
    return ortspec.convert(models.checkpoint("base"), out, num_speculative_tokens=WINDOWED_K,
                           max_length=WINDOWED_MAX_LENGTH, progress=False)
