"""Sampling: the transform against transformers' warpers and against its ONNX twin, the
speculative acceptance rule against its target distribution, seeds, state exactness after
every commit of a sampled run, and the refusals (bad arguments, a directory converted before
the sampling graphs)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto

import ortspec
from ortspec.converter.builder import GraphBuilder, WeightStore
from ortspec.converter.sampling_graph import RowParams, make_draw, make_sampling_probs
from ortspec.runtime import custom_ops
from ortspec.runtime.states import Rows
from ortspec.speculative import sampling
from ortspec.speculative.decoder import Decoder
from ortspec.speculative.exactness import row_state
from ortspec.speculative.stats import Stats

F32, I64 = TensorProto.FLOAT, TensorProto.INT64
PROMPTS = [[5, 17, 99, 3, 250, 7, 11], [42], [8, 8, 8, 300, 1, 2]]
HOT = dict(temperature=1.5, top_k=20, top_p=0.9)


def hf_transform(logits, temperature, top_k, top_p):
    """transformers' own warpers, one row at a time: the reference semantics."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    rows = []
    for row, t, k, p in zip(torch.tensor(logits, dtype=torch.float64), temperature, top_k, top_p):
        scores = TemperatureLogitsWarper(float(t))(None, row[None])
        if k:
            scores = TopKLogitsWarper(int(k))(None, scores)
        if p < 1:
            scores = TopPLogitsWarper(float(p))(None, scores)
        rows.append(scores.softmax(-1)[0].numpy())
    return np.stack(rows)


PARAMS = dict(temperature=np.array([1.0, 0.5, 2.0, 1.0, 0.7]), top_k=np.array([0, 5, 3, 0, 40]),
              top_p=np.array([1.0, 1.0, 0.8, 0.5, 0.9]))


def test_transform_matches_transformers_warpers():
    logits = np.random.default_rng(0).normal(0, 3, (5, 40))
    ours = sampling.transform(logits, **PARAMS)
    np.testing.assert_allclose(ours, hf_transform(logits, **PARAMS), atol=1e-12)
    assert ((ours > 0).sum(axis=1) <= np.where(PARAMS["top_k"] > 0, PARAMS["top_k"], 40)).all()


def sampling_graph(vocab):
    """make_sampling_probs + make_draw alone, as an ONNX Runtime session."""
    g = GraphBuilder("sampling", WeightStore())
    logits = g.input("logits", F32, ["B", 1, vocab])
    probs = make_sampling_probs(g, logits, RowParams.inputs(g), vocab)
    g.output(make_draw(g, probs, g.input("u", F32, ["B", 1]), vocab), "token", I64, ["B", 1])
    g.output(probs, "probs", F32, ["B", 1, vocab])
    return ort.InferenceSession(g.build({}).SerializeToString(), custom_ops.session_options())


def test_onnx_transform_and_draw_equal_the_numpy_ones():
    """The head's drafts go through the graph's transform, the target's through numpy's: the same
    distributions and the same draws (up to float32 rounding at the boundaries)."""
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, (5, 1, 40)).astype(np.float32)
    u = rng.random((5, 1), dtype=np.float32)
    token, probs = sampling_graph(40).run(None, {
        "logits": logits, "temperature": PARAMS["temperature"].astype(np.float32), "top_k": PARAMS["top_k"],
        "top_p": PARAMS["top_p"].astype(np.float32), "min_p": np.zeros(5, np.float32), "u": u})
    want = sampling.transform(logits[:, 0], **PARAMS)
    np.testing.assert_allclose(probs[:, 0], want, atol=1e-6)
    np.testing.assert_array_equal(probs[:, 0] > 0, want > 0)
    np.testing.assert_array_equal(token[:, 0], sampling.draw(want, u[:, 0]))


def test_draw_never_returns_a_token_of_probability_zero():
    weights = np.array([[0.0, 0.3, 0.7, 0.0], [0.5, 0.0, 0.0, 0.0]])
    assert sampling.draw(weights, np.array([0.9999999, 0.9999999])).tolist() == [2, 0]
    assert sampling.draw(weights, np.array([0.0, 0.0])).tolist() == [1, 0]


def accept_frequencies(p, q, accept=sampling.speculative_accept, n=200_000, seed=0):
    """Frequencies of the first token emitted by one speculative step, drafts drawn from q."""
    rng = np.random.default_rng(seed)
    k = q.shape[0]
    drafts = np.stack([sampling.draw(np.broadcast_to(q[i], (n, q.shape[1])), rng.random(n)) for i in range(k)], 1)
    a, token = accept(np.broadcast_to(p, (n,) + p.shape), np.broadcast_to(q, (n,) + q.shape), drafts,
                      rng.random((n, k)), rng.random(n))
    first = np.where(a > 0, drafts[:, 0], token)
    return np.bincount(first, minlength=p.shape[1]) / n


def test_speculative_accept_emits_the_target_distribution():
    """The first emitted token of a step is distributed as p_0 (within 4 sigma of 200,000 draws),
    though the drafts come from another distribution; accepting every draft (the planted bug)
    emits q_1 instead."""
    rng = np.random.default_rng(2)
    p, q = rng.dirichlet(np.ones(6), size=3), rng.dirichlet(np.ones(6), size=2)  # k = 2
    sigma = np.sqrt(p[0] * (1 - p[0]) / 200_000)
    assert np.all(np.abs(accept_frequencies(p, q) - p[0]) < 4 * sigma + 1e-9)

    def accept_all(p, q, drafts, u_accept, u_emit):
        return sampling.speculative_accept(p, q, drafts, np.zeros_like(u_accept), u_emit)

    assert np.abs(accept_frequencies(p, q, accept_all) - p[0]).max() > 0.05


@pytest.fixture(scope="module")
def model(models):
    return models.converted("base")


def test_same_seed_same_tokens_whatever_runs_beside_it(model):
    """For a given k: one seed gives one continuation, for either commit, alone or in a batch (as
    prompt 0), and through the batcher; another seed gives another."""
    select = ortspec.Session(model, num_speculative_tokens=3)
    alone = select.generate(PROMPTS[0], max_new_tokens=24, seed=7, **HOT)
    assert select.generate(PROMPTS, max_new_tokens=24, seed=7, **HOT)[0] == alone
    readvance = ortspec.Session(model, num_speculative_tokens=3, commit="readvance")
    assert readvance.generate(PROMPTS[0], max_new_tokens=24, seed=7, **HOT) == alone
    with select.batcher(max_batch_size=2) as batcher:
        other = batcher.add_request(PROMPTS[1], max_new_tokens=30, seed=3, **HOT)
        batcher.step()
        rid = batcher.add_request(PROMPTS[0], max_new_tokens=24, seed=7, **HOT)
        while batcher.pending:
            batcher.step()
        assert batcher.result(rid) == alone and batcher.result(other)
    assert select.generate(PROMPTS[0], max_new_tokens=24, seed=8, **HOT) != alone
    greedy = select.generate(PROMPTS[0], max_new_tokens=24)
    assert select.generate(PROMPTS[0], max_new_tokens=24, temperature=0.0, seed=7) == greedy


@pytest.mark.parametrize("k", [0, 2])
def test_one_seed_per_prompt_gives_each_prompt_its_own_seeds_tokens(model, k):
    """generate(prompts, seed=[s0, s1, ...]): prompt i gets what generate(prompt_i, seed=s_i) and a
    batcher request with seed s_i get (stream 0 of its own seed), whatever runs beside it; a
    list of the wrong length or with a bad entry is refused before any work."""
    session = ortspec.Session(model, num_speculative_tokens=k)
    seeds = [7, 3, 2**63 - 1][: len(PROMPTS)]
    alone = [session.generate(p, max_new_tokens=20, seed=s, **HOT) for p, s in zip(PROMPTS, seeds)]
    assert session.generate(PROMPTS, max_new_tokens=20, seed=seeds, **HOT) == alone
    assert session.generate(PROMPTS, max_new_tokens=20, seed=np.array(seeds), **HOT) == alone
    assert session.generate(PROMPTS[1], max_new_tokens=20, seed=(seeds[1],), **HOT) == alone[1]
    with session.batcher(max_batch_size=2) as batcher:
        rid = batcher.add_request(PROMPTS[1], max_new_tokens=20, seed=seeds[1], **HOT)
        while batcher.pending:
            batcher.step()
        assert batcher.result(rid) == alone[1]
    assert session.generate(PROMPTS, max_new_tokens=20, seed=seeds[::-1], **HOT)[0] != alone[0]
    requests = session.stats["requests"]
    for bad, match in [(seeds[:1] + seeds, r"seed has \d+ entries for \d+ prompts"), ([-1] * len(PROMPTS), r"seed\[0\]=-1"),
                       ([1.5] * len(PROMPTS), r"seed\[0\]=1.5 must be an integer")]:
        with pytest.raises(ortspec.InputError, match=match):
            session.generate(PROMPTS, max_new_tokens=4, seed=bad, **HOT)
    assert session.stats["requests"] == requests


def forced_decode_states(decoder: Decoder, prompt: list[int], tokens: list[int]) -> dict:
    """Plain decode of prompt + tokens, one token per forward, the head fed every token (what a
    greedy decode over these tokens leaves): {length T: (target state, head state)} of row 0."""
    rows, n, sequence = Rows([0]), len(prompt), list(prompt) + list(tokens)
    decoder.target.reset(rows)
    positions = np.arange(n)[None]
    out = decoder.target.prefill(rows, np.array([prompt]), positions)
    decoder.mtp.catch_up(rows, out["hidden"], np.array([sequence[1: n + 1]]), positions, np.array([n - 1]), 3)
    table = {n: (decoder.target.states.row_state(0, n), decoder.mtp.row_state(0, n))}
    for T in range(n, len(sequence) - 1):
        out = decoder.target.decode(rows, np.array([[sequence[T]]]), np.array([[T]]))
        decoder.mtp.catch_up(rows, out["hidden"], np.array([[sequence[T + 1]]]), np.array([[T]]), np.array([0]), 3)
        table[T + 1] = (decoder.target.states.row_state(0, T + 1), decoder.mtp.row_state(0, T + 1))
    return table


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("commit,fixed_rows,exact", [("select", False, False), ("readvance", False, False),
                                                    ("select", True, False), ("readvance", None, True)])
def test_sampled_states_equal_a_plain_decode_after_every_commit(model, commit, fixed_rows, exact):
    """Sampling changes which tokens are committed, never how: after every commit each request's
    states are bitwise those of a plain decode over the tokens it got (in exact mode too: 3
    requests in two groups of 2 rows, every forward 2 x 5 tokens)."""
    session = ortspec.Session(model, num_speculative_tokens=3, commit=commit, exact=exact, exact_batch_size=2)
    seen = {}

    def record(decoder, batch):
        for req in batch.requests:
            if not req.done:
                state = row_state(decoder.engine, req)
                seen[(tuple(req.prompt), req.processed)] = (state.target, state.mtp)

    outs = session.generate(PROMPTS, max_new_tokens=20, seed=5, on_commit=record, fixed_rows=fixed_rows, **HOT)
    assert session.stats["accept_histogram"][0] < session.stats["speculative_row_steps"]  # drafts were accepted
    plain = Decoder(session.graphs, 1, 3, "select", Stats())
    for prompt, out in zip(PROMPTS, outs):
        table = forced_decode_states(plain, prompt, out)
        lengths = [T for (p, T) in seen if p == tuple(prompt)]
        assert len(lengths) >= 5
        for T in lengths:
            target, mtp = seen[(tuple(prompt), T)]
            assert same(target, table[T][0]) and same(mtp, table[T][1]), f"prompt {prompt[:3]} length {T}"


@pytest.mark.parametrize("k", [0, 2])
def test_min_p_one_keeps_only_the_most_probable_token(model, k):
    """min_p = 1 cuts every token less probable than the most probable one: sampling at any
    temperature is then greedy, whatever k (the draws on the device and in the host's acceptance);
    a small min_p leaves sampling random."""
    session = ortspec.Session(model, num_speculative_tokens=k)
    greedy = session.generate(PROMPTS, max_new_tokens=24)
    assert session.generate(PROMPTS, max_new_tokens=24, temperature=1.5, min_p=1.0, seed=3) == greedy
    with session.batcher(max_batch_size=2) as batcher:
        rid = batcher.add_request(PROMPTS[1], max_new_tokens=24, temperature=1.5, min_p=1.0, seed=4)
        while batcher.pending:
            batcher.step()
        assert batcher.result(rid) == greedy[1]
    assert session.generate(PROMPTS, max_new_tokens=24, temperature=1.5, min_p=1e-6, seed=3) != greedy


@pytest.mark.parametrize("arguments,match", [
    (dict(temperature=-1.0), r"temperature=-1.0 must be a finite number >= 0"),
    (dict(temperature=float("nan")), r"temperature=nan must be a finite number"),
    (dict(temperature=True), r"temperature=True must be a finite number"),
    (dict(temperature="hot"), r"temperature='hot' must be a finite number"),
    (dict(temperature=1e-9), r"temperature=1e-09 is below 0.0001.*use temperature=0 for greedy"),
    (dict(temperature=1.0, top_k=-1), r"top_k=-1 must be an integer >= 0 \(0 keeps every token\)"),
    (dict(temperature=1.0, top_k=2.5), r"top_k=2.5 must be an integer"),
    (dict(temperature=1.0, top_p=0.0), r"top_p=0.0 must be a number in \(0, 1\]"),
    (dict(temperature=1.0, top_p=1.5), r"top_p=1.5 must be a number in \(0, 1\]"),
    (dict(temperature=1.0, seed=-3), r"seed=-3 must be an integer >= 0 or None"),
    (dict(temperature=1.0, seed=1.0), r"seed=1.0 must be an integer"),
    (dict(temperature=1.0, min_p=-0.1), r"min_p=-0.1 must be a number in \[0, 1\]"),
    (dict(temperature=1.0, min_p=float("nan")), r"min_p=nan must be a number in \[0, 1\]"),
    (dict(temperature=1.0, min_p="x"), r"min_p='x' must be a number"),
    (dict(stream="yes"), r"stream='yes' must be True or False"),
])
def test_bad_sampling_arguments_are_refused_before_any_work(model, arguments, match):
    session = ortspec.Session(model, num_speculative_tokens=2)
    with pytest.raises(ortspec.InputError, match=match):
        session.generate(PROMPTS[0], max_new_tokens=4, **arguments)
    if "stream" not in arguments:
        with session.batcher(max_batch_size=1) as batcher, pytest.raises(ortspec.InputError, match=match):
            batcher.add_request(PROMPTS[0], max_new_tokens=4, **arguments)
    assert session.stats["requests"] == 0
    assert len(session.generate(PROMPTS[0], max_new_tokens=4, temperature=1.0, seed=0)) == 4


def test_a_directory_converted_before_the_sampling_graphs(model, tmp_path):
    """Greedy keeps working, speculatively too; sampling with k = 0 works; sampling with drafts is
    refused with the command that reconverts."""
    old = tmp_path / "old"
    shutil.copytree(model, old)
    manifest = json.loads((old / "manifest.json").read_text())
    for name in [n for n in manifest["graphs"] if n.startswith("mtp_sample")]:
        (old / manifest["graphs"].pop(name)["file"]).unlink()
        del manifest["files"][f"{name}.onnx"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    session = ortspec.Session(old, num_speculative_tokens=2)
    greedy = ortspec.Session(model).generate(PROMPTS[0], max_new_tokens=8)
    assert session.generate(PROMPTS[0], max_new_tokens=8) == greedy
    with pytest.raises(ortspec.ModelDirError, match=r"no mtp_sample_k2.onnx.*ortspec convert .* --overwrite"):
        session.generate(PROMPTS[0], max_new_tokens=8, temperature=1.0)
    assert len(ortspec.Session(old).generate(PROMPTS[0], max_new_tokens=8, temperature=1.0)) == 8
