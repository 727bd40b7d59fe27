"""The ai.ortspec custom ops on the CPU provider (csrc/core/sampling_ops.h): SamplingThreshold keeps
the reference transform's tokens, Draw draws the reference's token, SampleToken does both from the
logits (a greedy row's token is the argmax it is given), all exact in integers (so the CUDA
kernels can match them bit for bit: tools/gpu_suite/sampling_ops.py checks that on a GPU), and bad
shapes give an error, not a crash, with the session usable after it."""

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


SAMPLE_INPUTS = (("logits", F32), ("greedy", I64), ("temperature", F32), ("top_k", I64), ("top_p", F32),
                 ("min_p", F32), ("u", F32))


@pytest.fixture(scope="module")
def sample_session() -> ort.InferenceSession:
    """token = SampleToken(logits, greedy, temperature, top_k, top_p, min_p, u)."""
    node = helper.make_node("SampleToken", [n for n, _ in SAMPLE_INPUTS], ["token"], domain=ORTSPEC_DOMAIN)
    graph = helper.make_graph([node], "sample", [helper.make_tensor_value_info(n, t, None) for n, t in SAMPLE_INPUTS],
                              [helper.make_tensor_value_info("token", I64, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(ORTSPEC_DOMAIN, 1)],
                              ir_version=10)
    return ort.InferenceSession(model.SerializeToString(), custom_ops.session_options(),
                                providers=["CPUExecutionProvider"])


def sample(session, logits, temperature, top_k=None, top_p=None, min_p=None, u=None, greedy=None):
    B, N, _ = logits.shape
    feeds = {"logits": logits, "greedy": logits.argmax(-1) if greedy is None else greedy,
             "temperature": np.asarray(temperature, np.float32),
             "top_k": np.zeros(B, np.int64) if top_k is None else np.asarray(top_k, np.int64),
             "top_p": np.ones(B, np.float32) if top_p is None else np.asarray(top_p, np.float32),
             "min_p": np.zeros(B, np.float32) if min_p is None else np.asarray(min_p, np.float32),
             "u": np.zeros((B, N), np.float32) if u is None else u}
    return session.run(None, feeds)[0], feeds


def draw_bounds(probs: np.ndarray, u: np.ndarray, eps: float = 1e-5) -> tuple[np.ndarray, np.ndarray]:
    """The reference's draws [N] from probs [N, V] at u - eps and u + eps: a token between them is
    the reference's up to float32 rounding of the probabilities (a draw moves only where u is that
    near a boundary)."""
    u = u.astype(np.float64)
    low, high = (sampling.draw(probs, np.clip(u + d, 0.0, 1.0 - 1e-12)) for d in (-eps, eps))
    return low, high


def reference_bounds(feeds: dict, eps: float = 1e-5) -> tuple[np.ndarray, np.ndarray]:
    """draw_bounds [B, N] of the reference transform of the feeds' logits."""
    B, N, V = feeds["logits"].shape
    each = lambda x: np.repeat(x.astype(np.float64) if x.dtype == np.float32 else x, N)  # noqa: E731
    probs = sampling.transform(feeds["logits"].reshape(-1, V), each(feeds["temperature"]), each(feeds["top_k"]),
                               each(feeds["top_p"]), each(feeds["min_p"]))
    low, high = draw_bounds(probs, feeds["u"].reshape(-1), eps)
    return low.reshape(B, N), high.reshape(B, N)


@pytest.mark.parametrize("grid", [False, True], ids=["distinct", "ties"])
def test_sample_token_draws_the_references_token(sample_session, grid):
    """Rows of every kind (temperature alone, top-k, top-p, both, min-p, all three) over many
    uniforms: each token is the reference transform's draw (up to a uniform within 1e-5 of a
    boundary), so never outside its kept set, ties at the cut included."""
    rng = np.random.default_rng(11 if grid else 10)
    settings = [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (0.9, 40, 0.5, 0.0),
                (1.0, 0, 1.0, 0.05), (0.6, 20, 0.9, 0.01), (2.0, 1, 1.0, 0.0)]
    B, N, V = len(settings), 64, 500
    logits = rng.normal(0, 3, (B, 1, V))
    logits = np.repeat(np.round(logits * 2) / 2 if grid else logits, N, axis=1).astype(np.float32)
    temperature, top_k, top_p, min_p = (np.array(c) for c in zip(*settings))
    u = rng.random((B, N), dtype=np.float32)
    token, feeds = sample(sample_session, logits, temperature, top_k, top_p, min_p, u)
    low, high = reference_bounds(feeds)
    assert ((low <= token) & (token <= high)).all(), np.argwhere((token < low) | (token > high))[:5]
    assert (low == high).mean() > 0.99  # the bounds pin almost every draw down to one token


def test_sample_token_keeps_greedy_rows_and_falls_back_to_them(sample_session):
    """temperature 0: the greedy input's token, whatever the logits; min_p above 1 keeps nothing:
    the argmax too."""
    rng = np.random.default_rng(12)
    logits = rng.normal(0, 1, (3, 2, 300)).astype(np.float32)
    greedy = np.array([[7, 8], [9, 10], [11, 12]], np.int64)
    token, _ = sample(sample_session, logits, [0.0, 1.0, 0.8], min_p=[0.0, 0.0, 1.5], greedy=greedy,
                      u=rng.random((3, 2), dtype=np.float32))
    assert token[0].tolist() == [7, 8] and token[2].tolist() == [11, 12]
    assert token[1].tolist() != [9, 10]


def test_sample_token_at_qwen35s_vocabulary(sample_session):
    rng = np.random.default_rng(13)
    logits = rng.normal(0, 2, (2, 3, 248_320)).astype(np.float32)
    token, feeds = sample(sample_session, logits, [0.8, 1.0], [0, 50], [0.95, 0.9], [0.0, 0.0],
                          rng.random((2, 3), dtype=np.float32))
    low, high = reference_bounds(feeds)
    assert ((low <= token) & (token <= high)).all()


def test_sample_token_bad_shapes_are_an_error_and_the_session_goes_on(sample_session):
    logits = np.zeros((2, 1, 10), np.float32)
    with pytest.raises(Exception, match="SampleToken: temperature .* must be \\[B\\]"):
        sample(sample_session, logits, [1.0, 1.0, 1.0])
    with pytest.raises(Exception, match="SampleToken: greedy .* must be \\[2, 1\\]"):
        sample(sample_session, logits, [1.0, 1.0], greedy=np.zeros((2, 2), np.int64))
    token, _ = sample(sample_session, logits, [1.0, 0.0])
    assert token.shape == (2, 1)


def test_sample_token_on_nan_logits_gives_a_token_in_range(sample_session):
    """A broken model's NaN logits: a token id inside the vocabulary, no crash (the weights of NaN
    count as the floor's)."""
    logits = np.random.default_rng(14).normal(0, 1, (2, 1, 300)).astype(np.float32)
    logits[0, 0, 5] = np.nan
    logits[1] = np.nan
    token, _ = sample(sample_session, logits, [1.0, 1.0], [0, 10], [0.9, 1.0], [0.0, 0.1],
                      np.full((2, 1), 0.5, np.float32), greedy=np.zeros((2, 1), np.int64))
    assert ((0 <= token) & (token < 300)).all()
