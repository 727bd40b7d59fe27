"""Drafts over a sub-vocabulary (converter/draft_vocab.py): the MTP head scores N tokens, its
drafts come back as full-vocabulary ids and its sampled distributions over the full vocabulary
(0 outside the map); the output and every state stay exactly greedy's."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest

import ortspec
from ortspec.errors import ConvertOptionError, ModelDirError
from ortspec.manifest import Manifest
from ortspec.runtime import custom_ops
from ortspec.runtime.graphs import GraphSet
from ortspec.speculative.drafts import MTPDrafts
from ortspec.speculative.exactness import check_speculative
from tools.make_tiny_checkpoint import make_checkpoint

PROMPTS = [[5, 17, 99, 3, 250, 7, 11], [42], [8, 8, 8, 300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
N = 256  # of the tiny preset's 512 tokens


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory):
    """A tiny checkpoint whose head often drafts the target's token (draft_agreement), converted
    with a draft vocabulary of N (float32 head, so drafts get accepted) and without one."""
    root = tmp_path_factory.mktemp("draft_vocab")
    ck = make_checkpoint(root / "ck", seed=4, draft_agreement=10.0)
    options = dict(num_speculative_tokens=3, max_length=128, mtp_quant="none", progress=False)
    return (ortspec.convert(ck, root / "mapped", draft_vocab=N, **options),
            ortspec.convert(ck, root / "full", draft_vocab=0, **options), ck)


def draft_tokens(model) -> np.ndarray:
    m = Manifest.load(model)
    entry = m.weights[m.draft_vocab["tensor"]]
    raw = np.fromfile(model / "weights.bin", np.uint8)[entry["offset"]: entry["offset"] + entry["length"]]
    return raw.view(np.int64)


def test_the_map_is_recorded_in_range_and_replaces_the_head(agreeing):
    mapped, full, _ = agreeing
    m = Manifest.load(mapped)
    assert m.draft_vocab == {"size": N, "source": "id order (no tokenizer)", "tensor": "draft_tokens"}
    tokens = draft_tokens(mapped)
    assert tokens.size == N and np.all(np.diff(tokens) > 0) and 0 <= tokens[0] and tokens[-1] < m.spec.vocab_size
    for graph in ("mtp_propose_k2", "mtp_sample_k2", "verify_mtp_k2"):
        weights = m.graphs[graph]["weights"]
        assert {"mtp.draft_head", "draft_tokens"} <= set(weights), graph
        assert m.weights["mtp.draft_head"]["shape"] == [m.spec.hidden_size, N]
    assert "draft_tokens" not in m.graphs["mtp"]["weights"]  # the one-pass reference keeps the full head
    assert Manifest.load(full).draft_vocab is None


@pytest.mark.parametrize("commit", ["select", "readvance"])
def test_speculative_equals_greedy_and_states_with_the_map(agreeing, commit):
    """The head's own drafts (from the map) at batch 3, k = 2 and 3: tokens equal greedy's, and
    after every commit every state equals the plain decode's bitwise; every draft lies in the map."""
    mapped, _, _ = agreeing
    greedy = ortspec.Session(mapped).generate(PROMPTS, max_new_tokens=40)
    allowed, proposed = set(draft_tokens(mapped).tolist()), []

    class Recorded(MTPDrafts):
        def propose(self, batch, k):
            drafts = super().propose(batch, k)
            proposed.extend(drafts[[not r.placeholder and bool(r.next_drafts) for r in batch.requests]].ravel())
            return drafts

    graphs = GraphSet(Manifest.load(mapped))
    for k in (2, 3):
        session = ortspec.Session(mapped, num_speculative_tokens=k, commit=commit)
        assert session.generate(PROMPTS, max_new_tokens=40) == greedy
        stats = check_speculative(graphs, PROMPTS, 40, k, commit, make_drafts=Recorded)
        assert stats.accepted > 0  # real drafts were accepted: every commit path ran
    assert proposed and set(int(t) for t in proposed) <= allowed


def test_sampled_drafts_are_a_distribution_over_the_full_vocabulary(agreeing):
    """mtp_sample_k2 (CPU and portable graphs): draft_probs [B, k, V], 0 outside the map, each row
    the full head's distribution renormalised over the map (no top-k/top-p: softmax over N
    logits); the drafts lie in the map and a greedy row's drafts are mtp_propose_k2's."""
    mapped, full, _ = agreeing
    tokens, V = draft_tokens(mapped), Manifest.load(mapped).spec.vocab_size
    outside = np.setdiff1d(np.arange(V), tokens)
    for provider in ("cpu", None):
        mapped_out = _run_head(mapped, "mtp_sample_k2", provider)
        full_out = _run_head(full, "mtp_sample_k2", provider)
        probs = mapped_out["draft_probs"]  # row 0 samples (T = 1), row 1 is greedy
        assert probs.shape == (2, 2, V) and np.all(probs[..., outside] == 0)
        np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
        first = full_out["draft_probs"][0, 0, tokens]  # draft 1 of row 0: both heads saw the same rows
        np.testing.assert_allclose(probs[0, 0, tokens], first / first.sum(), rtol=1e-4, atol=1e-7)
        assert np.isin(mapped_out["drafts"], tokens).all()
        assert (mapped_out["drafts"][1] == _run_head(mapped, "mtp_propose_k2", provider)["drafts"][1]).all()


def _run_head(model, graph: str, provider) -> dict:
    """One run of a head graph (provider "cpu": its CPU variant; None: the portable graph) on two
    requests of 3 catch-up rows, zero caches and seeded hidden rows; row 0 samples at T = 1."""
    m = Manifest.load(model)
    path = model / m.graph_entry(graph, provider)["file"]
    session = ort.InferenceSession(str(path), custom_ops.session_options(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {"input_ids": np.array([[5, 9, 3], [7, 1, 2]]), "positions": np.tile(np.arange(4, 7), (2, 1)),
             "hidden": rng.standard_normal((2, 3, m.spec.hidden_size)).astype(np.float32), "last": np.array([2, 1]),
             "temperature": np.array([1.0, 0.0], np.float32), "top_k": np.array([0, 0]),
             "top_p": np.array([1.0, 1.0], np.float32), "min_p": np.zeros(2, np.float32),
             "uniforms": np.full((2, 2), 0.37, np.float32)}
    wanted = {i.name for i in session.get_inputs()}
    feeds = {name: value for name, value in feeds.items() if name in wanted}
    feeds.update({name: np.zeros([2] + m.states[name]["shape"][1:], np.float32) for name in wanted - set(feeds)})
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def test_a_map_for_a_small_vocabulary_is_refused_or_left_off(agreeing, tmp_path, capsys):
    _, _, ck = agreeing
    with pytest.raises(ConvertOptionError, match="not below the model's vocabulary of 512 tokens"):
        ortspec.convert(ck, tmp_path / "all", draft_vocab=512, progress=False)
    with pytest.raises(ConvertOptionError, match="draft_vocab=-1 is not supported"):
        ortspec.convert(ck, tmp_path / "negative", draft_vocab=-1, progress=False)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text\n")
    auto = ortspec.convert(ck, tmp_path / "auto", num_speculative_tokens=1, max_length=32, draft_corpus=corpus,
                           progress=False)
    assert Manifest.load(auto).draft_vocab is None  # "auto" leaves a 512-token vocabulary whole
    said = capsys.readouterr().out
    assert f"draft_corpus {corpus} ignored" in said and "--draft-vocab N forces one" in said
    with pytest.raises(ConvertOptionError, match="needs the checkpoint's tokenizer.json"):
        ortspec.convert(ck, tmp_path / "corpus", draft_vocab=64, draft_corpus=corpus, progress=False)
    with pytest.raises(ConvertOptionError, match="asks for none"):
        ortspec.convert(ck, tmp_path / "none", draft_vocab=0, draft_corpus=corpus, progress=False)


def test_a_corpus_ranks_the_map_and_the_special_tokens_stay(tmp_path):
    """With a tokenizer: the eos and special tokens, then the corpus's most frequent tokens; an
    int4 head quantizes its draft columns and keeps no full-vocabulary copy."""
    from tokenizers import Tokenizer

    ck = make_checkpoint(tmp_path / "ck", seed=6, tokenizer=True)
    tokenizer = Tokenizer.from_file(str(ck / "tokenizer.json"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("draft target draft verify draft target\n" * 50)
    out = ortspec.convert(ck, tmp_path / "out", num_speculative_tokens=2, max_length=32, draft_vocab=8,
                          draft_corpus=corpus, progress=False)
    m = Manifest.load(out)
    counts = np.bincount(tokenizer.encode(corpus.read_text()).ids, minlength=m.spec.vocab_size)
    frequent = np.lexsort((np.arange(counts.size), -counts))[:5]
    assert sorted(draft_tokens(out).tolist()) == sorted({0, 1, 2} | set(frequent.tolist()))  # 3 specials + 5
    assert m.draft_vocab["source"].startswith("corpus corpus.txt") and m.mtp_quant == "int4"
    assert "mtp.draft_head.scales" in m.weights and "mtp.lm_head" not in m.weights
    prompt = tokenizer.encode("draft target").ids
    greedy = ortspec.Session(out).generate(prompt, max_new_tokens=12)
    assert ortspec.Session(out, num_speculative_tokens=2).generate(prompt, max_new_tokens=12) == greedy


def test_manifests_without_a_map_load_and_a_bad_one_is_refused(agreeing, tmp_path):
    import shutil

    mapped, _, _ = agreeing
    copy = tmp_path / "copy"
    shutil.copytree(mapped, copy)
    doc = json.loads((copy / "manifest.json").read_text())
    del doc["draft_vocab"]  # written before draft vocabularies existed
    (copy / "manifest.json").write_text(json.dumps(doc))
    assert Manifest.load(copy).draft_vocab is None
    doc["draft_vocab"] = {"size": 10**6, "source": "x", "tensor": "draft_tokens"}
    (copy / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ModelDirError, match="invalid draft_vocab"):
        Manifest.load(copy)
