"""Sampling on the device: the graphs' transform, draws and exact speculative acceptance against
the numpy reference (speculative.sampling), decode_sample and verify_mtp_sample_k{k} against the
greedy graphs (greedy rows bit for bit) and the reference (sampled rows), their runtime entry
points, the per-request uniforms, forking a prefilled row (n > 1), and the distributions: the
acceptance graph's and the model's through the device loop (tools/gpu_suite/sample_dist.py, the
GPU host's version of these tests, with small counts here)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

import ortspec
from ortspec.converter import sampling_graph
from ortspec.converter.builder import CPU, PORTABLE, GraphBuilder, WeightStore
from ortspec.converter.sampling_graph import CANDIDATES, NATIVE, SORT, RowParams
from ortspec.runtime import custom_ops
from ortspec.runtime.graphs import GraphSet
from ortspec.runtime.model import MTPHead, TargetModel
from ortspec.runtime.sampling_inputs import SamplingInputs
from ortspec.runtime.states import Rows
from ortspec.speculative import sampler, sampling
from ortspec.speculative.requests import Request
from tests.test_fused_verify import drafts_accepting, verify_feeds
from tests.test_sampling_ops import draw_bounds
from tools.gpu_suite import sample_dist

F32, I64 = TensorProto.FLOAT, TensorProto.INT64


def run_graph(g: GraphBuilder, feeds: dict) -> list:
    options = custom_ops.session_options()
    options.log_severity_level = 3
    session = ort.InferenceSession(g.build({}).SerializeToString(), options)
    return session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})


def transform_graph(vocab: int, rows: int, method: str) -> GraphBuilder:
    """logits [B, N, V] -> probs [B, N, V], tokens [B, N] (drawn, argmax on greedy rows); method:
    CANDIDATES (the CPU graphs), NATIVE (the portable graphs' ai.ortspec ops) or SORT (ONNX ops only)."""
    g = GraphBuilder("transform", WeightStore(), CPU if method == CANDIDATES else PORTABLE)
    logits, params = g.input("logits", F32, ["B", rows, vocab]), RowParams.inputs(g)
    tokens, probs = sampling_graph.make_token_choice(g, logits, params, g.input("u", F32, ["B", rows]), vocab,
                                                     method=method)
    g.output(probs, "probs", F32, ["B", rows, vocab])
    g.output(tokens, "tokens", I64, ["B", rows])
    return g


def reference(feeds: dict) -> np.ndarray:
    """speculative.sampling.transform of every row [B, N, V] (float64)."""
    B, N, V = feeds["logits"].shape
    each = lambda x: np.repeat(x.astype(np.float64) if x.dtype == np.float32 else x, N)  # noqa: E731
    probs = sampling.transform(feeds["logits"].reshape(-1, V).astype(np.float64), each(feeds["temperature"]),
                               each(feeds["top_k"]), each(feeds["top_p"]), each(feeds["min_p"]))
    return probs.reshape(B, N, V)


def robust_feeds(rng, B: int, N: int, V: int, top_k, top_p_rank, min_p_rank) -> dict:
    """Logits on a grid of 0.25 (many ties) and parameters [B] whose kept sets no float32 rounding
    can change: top_p half way between the reference's mass before two ranks (top_p_rank[b]: the
    ranks; None: off), min_p half way between two distinct scaled values below the largest (None: off)."""
    logits = np.round(rng.normal(0, 2, (B, N, V)) * 4) / 4
    temperature = rng.choice([0.5, 1.0, 1.7], B)
    top_p, min_p = np.ones(B), np.zeros(B)
    for b in range(B):
        z = np.sort(logits[b, 0] / temperature[b])[::-1]
        if top_p_rank[b] is not None:
            kept = z[: top_k[b]] if top_k[b] else z  # the reference's mass: over the top-k set
            mass = np.exp(kept - z[0]) / np.exp(kept - z[0]).sum()
            r = top_p_rank[b]
            top_p[b] = np.cumsum(mass)[r] - mass[r] / 2  # between before(r) and before(r + 1)
        if min_p_rank[b] is not None:
            values = np.unique(z)[::-1] - z[0]  # distinct, descending, from 0
            r = min_p_rank[b]
            min_p[b] = np.exp((values[r] + values[r + 1]) / 2)  # keeps the r + 1 largest distinct values
    if N > 1:  # the other rows' values must keep the same margins: copies of row 0, shuffled in order
        logits[:, 1:] = rng.permuted(np.repeat(logits[:, :1], N - 1, axis=1), axis=2)
    return {"logits": logits.astype(np.float32), "temperature": temperature.astype(np.float32),
            "top_k": np.asarray(top_k, np.int64), "top_p": top_p.astype(np.float32),
            "min_p": min_p.astype(np.float32), "u": rng.random((B, N), dtype=np.float32)}


# Per row: (top_k, top_p's rank, min_p's rank). With tiers (16, 64) over V = 300: inside the first
# tier, inside the second, past both (the full sort), top-k beyond a tier, and keeps-everything rows.
ROWS = {
    "temperature only": [(0, None, None)] * 3,
    "top-k inside": [(5, None, None), (16, None, None), (1, None, None)],
    "top-k past a tier": [(40, None, None), (200, None, None), (0, None, None)],
    "top-p": [(0, 3, None), (0, 30, None), (0, 150, None)],
    "top-k and top-p": [(20, 4, None), (100, 80, None), (8, 0, None)],
    "min-p": [(0, None, 2), (0, None, 9), (0, None, 0)],
    "mixed": [(0, None, None), (7, 4, 3), (250, None, None)],
}


@pytest.mark.parametrize("method", [NATIVE, SORT, CANDIDATES])
@pytest.mark.parametrize("case", list(ROWS))
def test_the_kept_set_is_the_references(monkeypatch, method, case):
    """The graphs' kept set equals speculative.sampling.transform's (ties included) for every kind
    of row and batch, the candidates' every tier and the full sort behind them; the probabilities
    agree to float32 rounding; with the same uniforms the draws are the reference's draws."""
    monkeypatch.setattr(sampling_graph, "CANDIDATE_TIERS", (16, 64))
    rng = np.random.default_rng(len(case))
    top_k, p_rank, m_rank = zip(*ROWS[case])
    feeds = robust_feeds(rng, 3, 2, 300, top_k, p_rank, m_rank)
    probs, tokens = run_graph(transform_graph(300, 2, method), feeds)
    want = reference(feeds)
    np.testing.assert_array_equal(probs > 0, want > 0)
    np.testing.assert_allclose(probs, want, atol=2e-6)
    np.testing.assert_array_equal(tokens, sampling.draw(want.reshape(6, 300), feeds["u"].reshape(-1)).reshape(3, 2))


@pytest.mark.parametrize("method", [NATIVE, SORT, CANDIDATES])
def test_ties_past_the_candidates_are_kept(monkeypatch, method):
    """30 tokens tie for the largest logit: top-k 5 and 16 keep all 30 (ties with the k-th value are
    kept), though the first tier (16 candidates, where both top-k sets lie) holds only 16 of them;
    top-k 40 keeps the 30 and 10 more (or more ties)."""
    monkeypatch.setattr(sampling_graph, "CANDIDATE_TIERS", (16, 64))
    for top_k in ((5, 16), (5, 40)):
        feeds = robust_feeds(np.random.default_rng(5), 2, 1, 300, top_k, (None, None), (None, None))
        feeds["logits"][:, 0, 100:130] = feeds["logits"].max() + 1.0
        probs, _ = run_graph(transform_graph(300, 1, method), feeds)
        want = reference(feeds)
        assert (want[0] > 0).sum() == 30 and (want[1] > 0).sum() >= (30 if top_k[1] == 16 else 40)
        np.testing.assert_array_equal(probs > 0, want > 0)
        np.testing.assert_allclose(probs, want, atol=2e-6)


def test_the_cpu_graphs_widen_the_candidates_only_where_a_row_needs_it(monkeypatch, tmp_path):
    """Kernels a batch runs (ONNX Runtime's profile): rows that keep every token run no TopK beside
    a row that fits the first tier (one TopK, of that tier's width); a batch with a row past every
    tier sorts all V; a batch that keeps every token runs no TopK at all."""
    import json

    monkeypatch.setattr(sampling_graph, "CANDIDATE_TIERS", (16, 64))
    model = transform_graph(300, 2, CANDIDATES).build({}).SerializeToString()

    def topk_count(rows) -> int:
        options = custom_ops.session_options()
        options.enable_profiling, options.profile_file_prefix = True, str(tmp_path / "profile")
        session = ort.InferenceSession(model, options)
        top_k, p_rank, m_rank = zip(*rows)
        feeds = robust_feeds(np.random.default_rng(0), 3, 2, 300, top_k, p_rank, m_rank)
        session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})
        return len([e for e in json.loads(Path(session.end_profiling()).read_text())
                    if e.get("cat") == "Node" and e["name"].startswith("TopK") and e["name"].endswith("kernel_time")])

    assert topk_count([(0, None, None), (0, 2, None), (0, None, None)]) == 1
    assert topk_count([(0, None, None), (0, 150, None), (3, None, None)]) == 3  # 16, 64, then all V
    assert topk_count([(0, None, None), (0, None, 4), (0, None, None)]) == 0


def test_wide_logits_give_no_subnormal_probabilities():
    """Logits spread over hundreds (a random model's): every probability is 0 or a normal float
    (subnormal arithmetic made the CPU's Softmax several times slower), and every token within
    e^64 of the largest has the plain Softmax's bits."""
    logits = (np.random.default_rng(3).normal(0, 60, (2, 1, 4096))).astype(np.float32)
    feeds = {"logits": logits, "temperature": np.array([1.0, 0.5], np.float32), "top_k": np.zeros(2, np.int64),
             "top_p": np.ones(2, np.float32), "min_p": np.zeros(2, np.float32), "u": np.zeros((2, 1), np.float32)}
    for method in (NATIVE, SORT, CANDIDATES):
        probs, _ = run_graph(transform_graph(4096, 1, method), feeds)
        assert not ((probs > 0) & (probs < np.finfo(np.float32).tiny)).any()
        z = logits * (1 / feeds["temperature"])[:, None, None]
        near = z - z.max(axis=2, keepdims=True) > sampling_graph.EXP_FLOOR
        g = GraphBuilder("softmax", WeightStore())
        g.output(g.op("Softmax", [g.input("z", F32, [2, 1, 4096])], axis=-1), "p", F32, None)
        (want,) = run_graph(g, {"z": z.astype(np.float32)})
        np.testing.assert_array_equal(probs[near], want[near])


def test_greedy_rows_take_the_argmax(monkeypatch):
    monkeypatch.setattr(sampling_graph, "CANDIDATE_TIERS", (16, 64))
    feeds = robust_feeds(np.random.default_rng(9), 3, 2, 300, (0, 5, 0), (None, None, 3), (None,) * 3)
    feeds["temperature"][[0, 2]] = 0.0
    for method in (NATIVE, SORT, CANDIDATES):
        _, tokens = run_graph(transform_graph(300, 2, method), feeds)
        np.testing.assert_array_equal(tokens[[0, 2]], feeds["logits"][[0, 2]].argmax(axis=2))


@pytest.mark.parametrize("target", [CPU, PORTABLE])
def test_drafts_come_from_the_truncated_head_on_the_cpu_and_its_tempered_one_elsewhere(target):
    """draft_sampler's q: the CPU graphs transform the head's logits as the target's (top-k 5 keeps
    5 tokens), the portable ones take Softmax(z / T) over all V (every token positive: no sort in a
    draft pass); the draws come from the q returned, and a greedy row takes the argmax."""
    vocab = 300
    g = GraphBuilder("drafts", WeightStore(), target)
    logits, params = g.input("logits", F32, ["B", 1, vocab]), RowParams.inputs(g)
    draft, q = sampling_graph.draft_sampler(g, params, g.input("uniforms", F32, ["B", 1]), 0, vocab)(logits, 0)
    g.output(draft, "draft", I64, ["B", 1])
    g.output(q, "q", F32, ["B", 1, vocab])
    rng = np.random.default_rng(4)
    feeds = {"logits": rng.normal(0, 2, (2, 1, vocab)).astype(np.float32), "temperature": np.array([0.7, 0.0], np.float32),
             "top_k": np.array([5, 5]), "top_p": np.array([0.9, 1.0], np.float32), "min_p": np.zeros(2, np.float32),
             "uniforms": np.array([[0.3], [0.3]], np.float32)}
    drafts, q = run_graph(g, feeds)
    kept = (q[0, 0] > 0).sum()
    assert kept <= 5 if target == CPU else kept == vocab
    want = sampling.transform(feeds["logits"][:1, 0].astype(np.float64), np.array([0.7]), np.array([5 if target == CPU else 0]),
                              np.array([0.9 if target == CPU else 1.0]))
    np.testing.assert_allclose(q[0, 0], want[0], atol=2e-6)
    assert drafts[0, 0] == sampling.draw(q[0].astype(np.float64), np.array([0.3]))[0]
    assert drafts[1, 0] == feeds["logits"][1, 0].argmax()


@pytest.mark.parametrize("vocab", [300, 97, 4096])  # blocks 15 x 20; 97 prime: padded to 10 x 10; 64 x 64
def test_draw_is_the_references(vocab):
    """The two-level inverse CDF against speculative.sampling.draw (one cumulative sum), zero
    weights included; a weight of 0 is never drawn, even at u next to 1."""
    rng = np.random.default_rng(vocab)
    weights = rng.random((4, 3, vocab)).astype(np.float32) * (rng.random((4, 3, vocab)) < 0.3)
    weights[0, 0, -5:] = 0.0
    u = rng.random((4, 3), dtype=np.float32)
    u[0, 0], u[1, 1] = np.nextafter(np.float32(1), np.float32(0)), 0.0
    g = GraphBuilder("draw", WeightStore())
    g.output(sampling_graph.make_draw(g, g.input("w", F32, ["B", 3, vocab]), g.input("u", F32, ["B", 3]), vocab),
             "tokens", I64, ["B", 3])
    (tokens,) = run_graph(g, {"w": weights, "u": u})
    np.testing.assert_array_equal(tokens, sampling.draw(weights.reshape(12, vocab).astype(np.float64),
                                                        u.reshape(-1)).reshape(4, 3))
    assert (np.take_along_axis(weights, tokens[..., None], axis=2) > 0).all()


@pytest.mark.parametrize("k", [1, 3])
def test_acceptance_is_the_references(k):
    """make_speculative_acceptance against speculative_accept on the same p, q, drafts, uniforms:
    the same accept lengths and tokens; rows where p = q (an empty residual) emit from p."""
    feeds = sample_dist.acceptance_rows(64, k, seed=k, vocab=12)
    rng = np.random.default_rng(k)
    feeds["p"] = rng.dirichlet(np.ones(12), (64, k + 1)).astype(np.float32)  # a p per row
    feeds["q"][:8] = feeds["p"][:8, :k]  # p = q: every draft accepted
    accepted, emitted = sample_dist.acceptance_session(12, k, "cpu").run(None, feeds)
    want_a, want_token = sampling.speculative_accept(feeds["p"].astype(np.float64), feeds["q"].astype(np.float64),
                                                     feeds["drafts"], feeds["u"][:, :k], feeds["u"][:, k])
    np.testing.assert_array_equal(accepted, want_a)
    np.testing.assert_array_equal(emitted, want_token)
    assert 0 < accepted.mean() < k and (accepted[:8] == k).all()


def test_acceptance_keeps_the_target_distribution_and_planted_rules_are_caught():
    """20,000 rows of fixed p_0..p_3 and q_1..q_3: each emitted e_i (given a >= i) follows p_i
    (goodness of fit, 4 tests at 1e-3 / 10 each), as ONNX ops and as ai.ortspec's ops; accepting
    with min(1, q/p), or emitting from p instead of the residual, is rejected (2 tests). A correct
    graph fails this test with probability <= 1e-3."""
    alpha = 1e-3 / 10
    assert min(sample_dist.acceptance_p_values(20_000, 3, seed=1)) > alpha
    assert min(sample_dist.acceptance_p_values(20_000, 3, seed=2, native=True)) > alpha  # the portable graphs' ops
    for planted in sample_dist.PLANTED.values():
        with sample_dist.planted_rule(planted):
            assert sample_dist.acceptance_p_values(20_000, 3, seed=7)[0] < alpha


# -- the model's graphs -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def graphs(models):
    return GraphSet(ortspec.Session(models.converted("base")).manifest)


def sampling_feeds(rng, B: int, uniforms: int, temperature) -> dict:
    return {"temperature": np.asarray(temperature, np.float32), "top_k": np.array([0, 20, 0, 5][:B], np.int64),
            "top_p": np.array([1.0, 0.9, 0.8, 1.0][:B], np.float32), "min_p": np.array([0, 0, 0, 0.1][:B], np.float32),
            "uniforms": rng.random((B, uniforms), dtype=np.float32)}


def test_decode_sample_draws_and_keeps_the_greedy_rows_argmax(graphs):
    """decode_sample beside decode on the same feeds: every output but the tokens equal; greedy
    rows' tokens decode's, bit for bit; sampled rows' the reference draw from decode's logits."""
    rng = np.random.default_rng(0)
    positions = np.array([[3], [40], [17], [99]], np.int64)
    feeds = verify_feeds(graphs, rng.integers(0, graphs.manifest.spec.vocab_size, (4, 1)), positions, rng)
    feeds = {n: v for n, v in feeds.items() if not n.endswith(".mtp")}
    sampled = sampling_feeds(rng, 4, 1, [0.0, 1.0, 0.7, 0.0])
    plain, drawn = graphs["decode"].run(feeds), graphs["decode_sample"].run({**feeds, **sampled})
    assert all(np.array_equal(plain[n], drawn[n]) for n in plain if n != "tokens")
    np.testing.assert_array_equal(drawn["tokens"][[0, 3]], plain["tokens"][[0, 3]])
    rows = [1, 2]
    probs = sampling.transform(plain["logits"][rows, 0].astype(np.float64), sampled["temperature"][rows].astype(float),
                               sampled["top_k"][rows], sampled["top_p"][rows].astype(float),
                               sampled["min_p"][rows].astype(float))
    np.testing.assert_array_equal(drawn["tokens"][rows, 0], sampling.draw(probs, sampled["uniforms"][rows, 0]))


@pytest.mark.parametrize("form", ["cpu", "portable"])
@pytest.mark.parametrize("k", [1, 3])
def test_verify_mtp_sample_is_the_greedy_step_for_greedy_rows_and_the_reference_for_sampled_ones(graphs, k, form):
    """verify_mtp_sample_k{k} beside verify_mtp_k{k}: all greedy, every output equal bit for bit;
    mixed, greedy rows' step_ids still verify_mtp's; sampled rows' accept lengths and emitted tokens
    speculative_accept's over the reference transform of the verify's logits and the given q, e_i =
    d_{i+1} before a; their drafts and the head's KV rows mtp_sample_k{k}'s over (e, a). For the
    CPU's variants (the steps in ONNX ops) and the portable graphs CUDA runs (ai.ortspec's
    TransformRows and SpeculativeAccept)."""
    run = (lambda name: graphs[name].run) if form == "cpu" else (lambda name: portable(graphs, name))  # noqa: E731
    if form == "portable":
        ops = {n.op_type for n in onnx.load(str(graphs.manifest.graph_path(f"verify_mtp_sample_k{k}")),
                                             load_external_data=False).graph.node}
        assert {"TransformRows", "SpeculativeAccept"} <= ops and "SamplingThreshold" not in ops
    rng = np.random.default_rng(k)
    V = graphs.manifest.spec.vocab_size
    positions = np.array([[t + i for i in range(k + 1)] for t in (3, 40, 17, 99)], np.int64)
    feeds = verify_feeds(graphs, rng.integers(0, V, (4, k + 1)), positions, rng)
    feeds["input_ids"] = drafts_accepting(graphs, k, feeds, [0, k, k // 2, min(1, k)])
    greedy = run(f"verify_mtp_k{k}")(feeds)
    q = rng.dirichlet(np.ones(V), (4, k)).astype(np.float32)
    sampled = {**sampling_feeds(rng, 4, 2 * k + 1, np.zeros(4)), "draft_probs": q}
    out = run(f"verify_mtp_sample_k{k}")({**feeds, **sampled})
    assert all(np.array_equal(greedy[n], out[n]) for n in greedy), "all greedy"
    sampled["temperature"] = np.array([0.0, 1.0, 1.5, 0.8], np.float32)
    out = run(f"verify_mtp_sample_k{k}")({**feeds, **sampled})
    np.testing.assert_array_equal(out["step_ids"][0], greedy["step_ids"][0])
    rows = [1, 2, 3]
    each = lambda x: np.repeat(x[rows], k + 1)  # noqa: E731
    p = sampling.transform(greedy["logits"][rows].reshape(-1, V).astype(np.float64),
                           *(each(sampled[n]).astype(np.float64) for n in ("temperature",)), each(sampled["top_k"]),
                           *(each(sampled[n]).astype(np.float64) for n in ("top_p", "min_p"))).reshape(3, k + 1, V)
    drafts = feeds["input_ids"][rows, 1:]
    a, token = sampling.speculative_accept(p, q[rows].astype(np.float64), drafts, sampled["uniforms"][rows, :k],
                                           sampled["uniforms"][rows, k])
    np.testing.assert_array_equal(out["accepted"][rows], a)
    emitted = out["step_ids"][rows, : k + 1]
    for j in range(3):
        assert emitted[j, : a[j]].tolist() == drafts[j, : a[j]].tolist() and emitted[j, a[j]] == token[j]
    head = run(f"mtp_sample_k{k}")({
        "input_ids": out["step_ids"][:, : k + 1], "hidden": greedy["hidden"], "positions": positions,
        "last": out["accepted"], "key.mtp": feeds["key.mtp"], "value.mtp": feeds["value.mtp"],
        **{n: sampled[n] for n in ("temperature", "top_k", "top_p", "min_p")}, "uniforms": sampled["uniforms"][:, k + 1:]})
    for name, ours in (("drafts", "drafts"), ("draft_probs", "draft_probs_out"), ("new_key.mtp", "new_key.mtp"),
                       ("new_value.mtp", "new_value.mtp")):
        assert np.array_equal(head[name], out[ours]), name


def test_the_entry_points_keep_the_drafts_distributions_on_the_device(graphs):
    """catch_up_sampled(on_device=True) and verify_with_head_sampled write what the next drafts
    were drawn from into head.draft_probs(k), the buffer the next verify reads (rows 1..2 here:
    row 0 of the buffer untouched); a step's forward reads as the greedy step's (step_ids)."""
    k, rows = 2, Rows([1, 2])
    target, head = TargetModel(graphs, 3), MTPHead(graphs, 3, k)
    rng = np.random.default_rng(4)
    prompt = np.array([[5, 17, 99, 3], [42, 8, 8, 1]], np.int64)
    positions = np.tile(np.arange(4), (2, 1))
    target.reset(rows)
    out = target.prefill(rows, prompt, positions)
    inputs = SamplingInputs(*(sampling_feeds(rng, 2, k, [1.0, 0.0])[n] for n in
                              ("temperature", "top_k", "top_p", "min_p", "uniforms")))
    next_ids = np.concatenate([prompt[:, 1:], out.tokens[:, -1:]], axis=1)
    drafts, probs = head.catch_up_sampled(rows, out["hidden"], next_ids, positions, np.array([3, 3]), k, inputs,
                                          graphed=False, on_device=True)
    buffer = head.draft_probs(k)  # [3, k, V]
    assert probs is None and not buffer[0].any() and np.allclose(buffer[1:].sum(axis=2), 1.0, atol=1e-5)
    ids = np.concatenate([next_ids[:, -1:], drafts], axis=1)
    step = SamplingInputs(*(sampling_feeds(rng, 2, 2 * k + 1, [1.0, 0.0])[n] for n in
                            ("temperature", "top_k", "top_p", "min_p", "uniforms")))
    before = buffer.copy()
    verified, accepted, next_drafts = target.verify_with_head_sampled(rows, ids, 4 + np.tile(np.arange(k + 1), (2, 1)),
                                                                     head, step)
    assert np.array_equal(verified.tokens, verified["step_ids"][:, : k + 1])
    assert np.array_equal(buffer[1:], verified["draft_probs_out"]) and not np.array_equal(buffer, before)
    assert np.array_equal(next_drafts, verified["drafts"]) and np.array_equal(accepted, verified["accepted"])


# -- per-request uniforms -----------------------------------------------------------------------------

def requests(params: list[sampling.SamplingParams]) -> list[Request]:
    return [Request(row=i, prompt=[1], max_new_tokens=9, sampling=p, random=sampling.random_stream(p, 0))
            for i, p in enumerate(params)]


def test_device_inputs_draw_a_fixed_count_per_request_from_its_own_stream():
    """k = 0: one uniform per sampled row, k: 2k + 1; greedy and done rows draw nothing and get
    temperature 0; a request's uniforms do not depend on the rows beside it (its seed's stream)."""
    hot = sampling.SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=3, min_p=0.02)
    alone = sampler.device_inputs(requests([hot]), 2)
    assert alone.uniforms.shape == (1, 5) and alone.top_k.tolist() == [5] and alone.min_p.tolist() == [np.float32(0.02)]
    batch = requests([sampling.GREEDY, hot, sampling.SamplingParams(temperature=1.0, seed=9), hot])
    batch[3].done = True
    inputs = sampler.device_inputs(batch, 2)
    np.testing.assert_array_equal(inputs.uniforms[1], alone.uniforms[0])
    assert inputs.temperature.tolist() == [0.0, np.float32(0.8), 1.0, 0.0]
    assert not inputs.uniforms[[0, 3]].any() and inputs.samples.tolist() == [False, True, True, False]
    assert sampler.device_inputs(batch, 0).uniforms.shape == (4, 1)
    with pytest.raises(ValueError, match=r"SamplingInputs.top_k: float32"):
        SamplingInputs(inputs.temperature, inputs.temperature, inputs.top_p, inputs.min_p, inputs.uniforms)


# -- n > 1: a prefilled row forked ----------------------------------------------------------------

def greedy_run(graphs, target: TargetModel, head: MTPHead, rows: Rows, tokens: np.ndarray, start: int, steps: int):
    """Plain greedy decode of rows from pending tokens [B] at position start, the head caught up
    each step (drafting 2); returns the tokens [B, steps]."""
    out_tokens = []
    for step in range(steps):
        positions = np.full((len(rows), 1), start + step, np.int64)
        out = target.decode(rows, tokens[:, None], positions)
        tokens = out.tokens[:, 0]
        head.catch_up(rows, out["hidden"], tokens[:, None], positions, np.zeros(len(rows), np.int64), 2, graphed=False)
        out_tokens.append(tokens)
    return np.stack(out_tokens, axis=1)


def test_forked_rows_at_temperature_0_equal_one_greedy_row_states_included(graphs):
    """A prompt prefilled once in row 0 and forked into rows 1..3 (target and head) decodes, row by
    row, the tokens of the same prompt alone in an engine of one row; after every row's run its
    states (target and head) equal that one row's, bitwise."""
    prompt, steps = [5, 17, 99, 3, 250, 7, 11], 12
    n = len(prompt)
    ids, positions, last = np.array([prompt]), np.arange(n)[None], np.array([n - 1])

    def prefilled(batch: int):
        target, head = TargetModel(graphs, batch), MTPHead(graphs, batch, 2)
        target.reset(Rows(range(batch)))
        out = target.prefill(Rows([0]), ids, positions)
        first = out.tokens[:, -1]
        head.catch_up(Rows([0]), out["hidden"], np.array([prompt[1:] + [int(first[0])]]), positions, last, 2,
                      graphed=False)
        return target, head, first

    one, one_head, first = prefilled(1)
    alone = greedy_run(graphs, one, one_head, Rows([0]), first, n, steps)
    target, head, first = prefilled(4)
    target.fork(0, Rows([1, 2, 3]))
    head.fork(0, Rows([1, 2, 3]))
    forked = greedy_run(graphs, target, head, Rows(range(4)), np.repeat(first, 4), n, steps)
    assert all(forked[j].tolist() == alone[0].tolist() for j in range(4))
    length = n + steps
    want = {**one.states.row_state(0, length), **one_head.row_state(0, length)}
    for j in range(4):
        got = {**target.states.row_state(j, length), **head.row_state(j, length)}
        assert want.keys() == got.keys() and all(np.array_equal(want[s], got[s]) for s in want), f"row {j}"


# -- the model's distribution through the device loop ---------------------------------------------------

@pytest.fixture(scope="module")
def spread(tmp_path_factory):
    root = tmp_path_factory.mktemp("device_spread")
    model = sample_dist.distribution_model(root / "model")
    with sample_dist.planted_rule(sample_dist.PLANTED["accept min(1, q/p)"]):
        planted = sample_dist.distribution_model(root / "planted")
    return model, planted


@pytest.mark.parametrize("k", [0, 1, 3])
def test_greedy_rows_beside_sampled_ones_decode_as_the_greedy_graphs(spread, k):
    assert sample_dist.greedy_rows_match(spread[0], k)


def test_device_speculative_sampling_keeps_the_joint_distribution(spread):
    """4,000 continuations of one prompt (forked) through decode_sample (k = 0) and
    verify_mtp_sample_k{k} (k = 1, 3): the first 5 tokens' joint distribution agrees with k = 0's
    (two tests at 1e-3 / 3); the model converted with the planted rule min(1, q/p) does not (one
    test at 1e-3 / 3). A correct sampler fails this test with probability <= 1e-3."""
    model, planted = spread
    alpha, config = 1e-3 / 3, sample_dist.CONFIGS[0]
    plain = sample_dist.continuations(model, 0, 4000, config, seed=100)
    for k in (1, 3):
        assert sample_dist.homogeneity_p_value(plain, sample_dist.continuations(model, k, 4000, config, 100 + k)) > alpha
    assert sample_dist.homogeneity_p_value(plain, sample_dist.continuations(planted, 3, 4000, config, 200)) < alpha


def portable(graphs, name: str):
    """graph ``name`` as the GPU runs it (not its CPU variant), run on the CPU: feeds -> {output: value}."""
    options = custom_ops.session_options()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(graphs.manifest.graph_path(name)), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return lambda feeds: dict(zip(names, session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})))


def untruncated_feeds(rng, B: int, uniforms: int) -> dict:
    """Rows that ask for neither top-k nor top-p: greedy, plain temperature, min-p, temperature 2."""
    return {"temperature": np.array([0.0, 0.8, 1.0, 2.0][:B], np.float32), "top_k": np.zeros(B, np.int64),
            "top_p": np.ones(B, np.float32), "min_p": np.array([0.0, 0.0, 0.1, 0.02][:B], np.float32),
            "uniforms": rng.random((B, uniforms), dtype=np.float32)}


def test_the_portable_decode_sample_is_one_op_that_draws_the_references_tokens(graphs):
    """The portable decode_sample (the graph CUDA runs: one ai.ortspec.SampleToken for the whole
    choice) beside the portable decode: every output but the tokens equal; greedy rows' tokens
    decode's; sampled rows' (top-k, top-p, min-p, plain) the reference's draws from the
    logits over many uniforms, up to a uniform within 1e-5 of a boundary."""
    rng = np.random.default_rng(5)
    positions = np.array([[3], [40], [17], [99]], np.int64)
    feeds = verify_feeds(graphs, rng.integers(0, graphs.manifest.spec.vocab_size, (4, 1)), positions, rng)
    feeds = {n: v for n, v in feeds.items() if not n.endswith(".mtp")}
    run = portable(graphs, "decode_sample")
    ops = {name: Counter(n.op_type for n in onnx.load(str(graphs.manifest.graph_path(name)),
                                                        load_external_data=False).graph.node)
           for name in ("decode", "decode_sample")}
    assert ops["decode_sample"] - ops["decode"] == Counter({"SampleToken": 1}) and not ops["decode"] - ops["decode_sample"]
    plain = portable(graphs, "decode")(feeds)
    for _ in range(25):
        sampled = sampling_feeds(rng, 4, 1, [0.0, 1.0, 0.7, 1.3])
        got = run({**feeds, **sampled})
        assert all(np.array_equal(plain[n], got[n]) for n in plain if n != "tokens")
        assert got["tokens"][0, 0] == plain["tokens"][0, 0]
        probs = sampling.transform(plain["logits"][1:, 0].astype(np.float64), sampled["temperature"][1:].astype(float),
                                   sampled["top_k"][1:], sampled["top_p"][1:].astype(float),
                                   sampled["min_p"][1:].astype(float))
        low, high = draw_bounds(probs, sampled["uniforms"][1:, 0])
        assert ((low <= got["tokens"][1:, 0]) & (got["tokens"][1:, 0] <= high)).all()


@pytest.mark.parametrize("form", ["cpu", "portable"])
def test_sample_logits_draws_the_references_tokens_from_a_prefills_last_row(graphs, form):
    """sample_logits over a prefill's logits (its last row's alone, [B, 1, V]), in the CPU graph and
    the portable one (what CUDA runs): greedy rows' tokens the prefill's argmax, sampled rows' the
    reference's draws (top-k, top-p, min-p, plain), up to a uniform within 1e-5 of a boundary."""
    rng = np.random.default_rng(9)
    V = graphs.manifest.spec.vocab_size
    target = TargetModel(graphs, 4)
    target.reset(Rows([0, 1, 2, 3]))
    ids = rng.integers(0, V, (4, 6))
    out = target.prefill(Rows([0, 1, 2, 3]), ids, np.tile(np.arange(6), (4, 1)))
    assert out["logits"].shape == (4, 1, V) and target.samples_last_rows(out)
    run = portable(graphs, "sample_logits") if form == "portable" else (lambda f: graphs["sample_logits"].run(f))
    for _ in range(25):
        sampled = sampling_feeds(rng, 4, 1, [0.0, 1.0, 0.7, 1.3])
        got = run({"logits": out["logits"], **sampled})["tokens"]
        assert got.shape == (4, 1) and got[0, 0] == out.tokens[0, 0]
        probs = sampling.transform(out["logits"][1:, 0].astype(np.float64), sampled["temperature"][1:].astype(float),
                                   sampled["top_k"][1:], sampled["top_p"][1:].astype(float),
                                   sampled["min_p"][1:].astype(float))
        low, high = draw_bounds(probs, sampled["uniforms"][1:, 0])
        assert ((low <= got[1:, 0]) & (got[1:, 0] <= high)).all()


def test_a_prefills_sampled_first_tokens_are_drawn_where_the_logits_lie(models, monkeypatch):
    """The decoder draws a prefill's sampled first tokens through sample_logits (one uniform per
    request, as the host's pick draws), so seeded requests keep the host path's tokens; forks of
    one prompt (n > 1) draw apart on the host; a greedy call never runs it."""
    session = ortspec.Session(models.converted("base"), num_speculative_tokens=2)
    prompts = [[5, 17, 99, 3], [42, 8, 8], [1, 2, 3, 4]]
    calls = []
    real = TargetModel.sample_last_rows
    monkeypatch.setattr(TargetModel, "sample_last_rows", lambda self, out, inputs: calls.append(1) or real(self, out, inputs))
    options = [dict(temperature=0.8, top_p=0.9, seed=s) for s in range(6)] + [dict(temperature=1.0, top_k=5, seed=7)]
    on_device = [session.generate(prompts, max_new_tokens=6, **o) for o in options]
    assert len(calls) >= len(options)  # one per prefill
    drawn = len(calls)
    session.generate(prompts, max_new_tokens=6)
    session.generate(prompts[:1] * 3, max_new_tokens=6, temperature=0.8, seed=3)  # forks of one row
    assert len(calls) == drawn
    monkeypatch.setattr(TargetModel, "samples_last_rows", lambda self, out: False)
    assert [session.generate(prompts, max_new_tokens=6, **o) for o in options] == on_device


def test_no_conversion_writes_tempered_graphs_and_no_decoder_runs_them(models):
    """The tempered graphs (decode_tempered, verify_mtp_tempered_k{k}: no top-k / top-p, for
    batches where no row truncates) spared the sorting graphs' search; ortspec's ops skip it per
    row, so conversions no longer write them and a Decoder samples on the sample graphs alone."""
    out = models.converted("base")
    manifest = ortspec.manifest.Manifest.load(out)
    assert not [name for name in manifest.graphs if "tempered" in name]
    with ortspec.Session(out, num_speculative_tokens=2).batcher(max_batch_size=2) as batcher:
        kinds = batcher.decoder.kinds
        assert kinds.sampled_ks == set(range(manifest.num_speculative_tokens + 1))
        rid = batcher.add_request([5, 6, 7], max_new_tokens=8, temperature=0.8, top_p=0.9, seed=1)
        while batcher.pending:
            batcher.step()
        assert len(batcher.result(rid)) == 8


def test_a_conversion_may_leave_the_sampling_graphs_out(models, tmp_path):
    """sampling_graphs=False writes neither decode_sample nor verify_mtp_sample_k{k} (nor their
    variants); anything but a bool is refused before any work."""
    from tests.small_models import convert_small

    out = convert_small(models.checkpoint("base"), tmp_path / "out", sampling_graphs=False)
    names = set(ortspec.Session(out).manifest.graphs)
    assert "decode" in names and "verify_mtp_k1" in names and "mtp_sample_k1" in names
    assert not any(n == "decode_sample" or n.startswith("verify_mtp_sample") for n in names)
    with pytest.raises(ortspec.ConvertOptionError, match=r"sampling_graphs='no' must be True or False"):
        convert_small(models.checkpoint("base"), tmp_path / "bad", sampling_graphs="no")
    assert not (tmp_path / "bad").exists()


def test_the_gpu_hosts_subcommand_runs_on_the_cpu(monkeypatch, tmp_path):
    """tools/gpu.py sample_dist end to end with 1,000 samples and one sampling configuration: every
    check passes (the planted rules' p-values are far below the threshold) and the JSON holds them."""
    import json

    from tools import gpu

    monkeypatch.setattr(sample_dist, "CONFIGS", sample_dist.CONFIGS[:1])
    status = gpu.main(["sample_dist", "--samples", "1000", "--provider", "cpu", "--out", str(tmp_path / "work"),
                       "--json", str(tmp_path / "result.json")])
    result = json.loads((tmp_path / "result.json").read_text())
    assert status == 0 and result["samples"] == 1000 and len(result["checks"]) == 2 * 3 + 2 + 4 + 3 + 1 + 2
    assert result["checks"]["planted model"] < result["alpha_per_test"]


def test_the_cost_tools_run_on_the_cpu(models, graphs, capsys):
    """tools/device_sampling_cost.py (and its Steps, which tools/gpu.py sample_cost times on CUDA):
    one line per k and batch, both kinds of step timed."""
    from tools import device_sampling_cost
    from tools.gpu_suite import sample_cost

    device_sampling_cost.main([str(models.converted("base")), "-k", "0,2", "--batch", "1,2", "--steps", "2",
                               "--rounds", "1", "--clock", "cpu", "--top-p", "0.9"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + 4 and all(len(line.split()) == 5 for line in lines[2:])
    timer = device_sampling_cost.Steps(graphs, 2, 2, sample_cost.CONFIGS["temperature 0.8, top-p 0.95"],
                                       np.random.default_rng(0))
    assert all(ms > 0 for ms in sample_cost.step_ms(timer, 2, 1))


def test_the_draft_temperature_tool_converts_at_each_tau(models, capsys):
    """tools/draft_temperature.py: a row per tau, each an acceptance rate in [0, 1]; the converter's
    own draft_sampler back in place after it."""
    from tools import draft_temperature

    draft_temperature.main([str(models.checkpoint("base")), "--taus", "0.5,1.0", "-k", "1", "--seeds", "1"])
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()[2:]]
    assert [float(r[1]) for r in rows] == [0.5, 1.0] and all(0 <= float(c) <= 1 for r in rows for c in r[2:4])
    assert sampling_graph.draft_sampler is draft_temperature.DRAFT_SAMPLER
    from ortspec.converter import fused_graph, graphs as graph_module
    assert fused_graph.draft_sampler is graph_module.draft_sampler is draft_temperature.DRAFT_SAMPLER
