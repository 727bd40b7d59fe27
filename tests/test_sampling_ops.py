"""The ai.ortspec custom ops on the CPU provider (csrc/core/sampling_ops.h): SamplingThreshold keeps
the reference transform's tokens, Draw draws the reference's token, both exact in integers (so the
CUDA kernels can match them bit for bit: tools/gpu_suite/sampling_ops.py checks that on a GPU), and
bad shapes give an error, not a crash, with the session usable after it."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ortspec.converter.builder import ORTSPEC_DOMAIN
from ortspec.runtime import custom_ops
from ortspec.speculative import sampling

F32, I64 = TensorProto.FLOAT, TensorProto.INT64


def ops_session() -> ort.InferenceSession:
    """threshold = SamplingThreshold(z, probs, top_k, top_p), index = Draw(weights, u)."""
    nodes = [helper.make_node("SamplingThreshold", ["z", "probs", "top_k", "top_p"], ["threshold"], domain=ORTSPEC_DOMAIN),
             helper.make_node("Draw", ["weights", "u"], ["index"], domain=ORTSPEC_DOMAIN)]
    inputs = [helper.make_tensor_value_info(n, t, None) for n, t in
              (("z", F32), ("probs", F32), ("top_k", I64), ("top_p", F32), ("weights", F32), ("u", F32))]
    outputs = [helper.make_tensor_value_info("threshold", F32, None), helper.make_tensor_value_info("index", I64, None)]
    model = helper.make_model(helper.make_graph(nodes, "ops", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(ORTSPEC_DOMAIN, 1)],
                              ir_version=10)
    return ort.InferenceSession(model.SerializeToString(), custom_ops.session_options(),
                                providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def session():
    return ops_session()


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


def run(session, z, top_k, top_p, weights=None, u=None):
    B, N, _ = z.shape
    weights = softmax(z) if weights is None else weights
    u = np.zeros((B, N), np.float32) if u is None else u
    return session.run(None, {"z": z, "probs": softmax(z), "top_k": np.asarray(top_k, np.int64),
                              "top_p": np.asarray(top_p, np.float32), "weights": weights, "u": u})


def reference_kept(z: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    probs = sampling.transform(z[None].astype(np.float64), np.array([1.0]), np.array([top_k]), np.array([top_p]))
    return probs[0] > 0


@pytest.mark.parametrize("grid", [False, True], ids=["distinct", "ties"])
def test_the_threshold_keeps_the_reference_tokens(session, grid):
    """Every kind of row: top-k alone (inside, at, past V), top-p alone, both, neither; on logits
    with many ties (a grid of 0.5) the tied values at the cut are kept as the reference keeps them."""
    rng = np.random.default_rng(1 if grid else 0)
    settings = [(0, 0.9), (5, 1.0), (40, 0.5), (0, 0.3), (3, 0.999), (0, 1.0), (2000, 0.95), (1, 0.9), (1000, 1.0)]
    B, N, V = len(settings), 3, 1000
    z = rng.normal(0, 3, (B, N, V))
    z = (np.round(z * 2) / 2 if grid else z).astype(np.float32)
    top_k, top_p = zip(*settings)
    threshold, _ = run(session, z, top_k, top_p)
    for b, (k, p) in enumerate(settings):
        for n in range(N):
            want = reference_kept(z[b, n], k, p)
            np.testing.assert_array_equal(z[b, n] >= threshold[b, n, 0], want, err_msg=f"row {b},{n}: k={k} p={p}")
    assert np.isneginf(threshold[5]).all() and np.isneginf(threshold[8]).all()  # nothing truncates: every token


def test_the_threshold_at_qwen35s_vocabulary(session):
    rng = np.random.default_rng(2)
    z = rng.normal(0, 2, (2, 1, 248_320)).astype(np.float32)
    threshold, _ = run(session, z, [0, 50], [0.95, 0.9])
    for b, (k, p) in enumerate([(0, 0.95), (50, 0.9)]):
        np.testing.assert_array_equal(z[b, 0] >= threshold[b, 0, 0], reference_kept(z[b, 0], k, p))


def test_the_draw_is_the_references(session):
    """Random weights with zeros among them (never drawn), uniforms across [0, 1) and at 0."""
    rng = np.random.default_rng(3)
    B, N, V = 4, 5, 777
    weights = rng.random((B, N, V)).astype(np.float32) * (rng.random((B, N, V)) < 0.3)
    weights /= weights.sum(axis=-1, keepdims=True)
    u = rng.random((B, N)).astype(np.float32)
    u[0, 0], u[1, 1] = 0.0, np.float32(1.0) - np.finfo(np.float32).epsneg
    _, index = run(session, np.zeros((B, N, V), np.float32), [0] * B, [1.0] * B, weights, u)
    want = sampling.draw(weights.reshape(-1, V).astype(np.float64), u.reshape(-1).astype(np.float64))
    np.testing.assert_array_equal(index.reshape(-1), want)
    assert (weights.reshape(-1, V)[np.arange(B * N), index.reshape(-1)] > 0).all()


def test_a_row_without_weight(session):
    """All zero: V - 1, as the reference; every weight below the fixed point's 2^-43: the largest."""
    weights = np.zeros((1, 2, 300), np.float32)
    weights[0, 1, [10, 20]] = [1e-30, 3e-30]
    _, index = run(session, np.zeros((1, 2, 300), np.float32), [0], [1.0], weights, np.full((1, 2), 0.5, np.float32))
    assert index.tolist() == [[299, 20]]


def test_the_ops_are_deterministic(session):
    rng = np.random.default_rng(4)
    z = rng.normal(0, 3, (3, 2, 5000)).astype(np.float32)
    u = rng.random((3, 2)).astype(np.float32)
    first = run(session, z, [0, 10, 0], [0.9, 0.8, 0.5], u=u)
    second = run(session, z, [0, 10, 0], [0.9, 0.8, 0.5], u=u)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


def test_bad_shapes_are_an_error_and_the_session_goes_on(session):
    z = np.zeros((2, 1, 10), np.float32)
    with pytest.raises(Exception, match="SamplingThreshold: top_k .* must be \\[B\\]"):
        session.run(None, {"z": z, "probs": z, "top_k": np.zeros(3, np.int64), "top_p": np.ones(2, np.float32),
                           "weights": z, "u": np.zeros((2, 1), np.float32)})
    with pytest.raises(Exception, match="Draw: u .* must be \\[2, 1\\]"):
        session.run(None, {"z": z, "probs": z, "top_k": np.zeros(2, np.int64), "top_p": np.ones(2, np.float32),
                           "weights": z, "u": np.zeros((2, 3), np.float32)})
    threshold, index = run(session, np.zeros((2, 1, 10), np.float32), [0, 0], [1.0, 1.0])
    assert index.shape == (2, 1) and np.isneginf(threshold).all()
