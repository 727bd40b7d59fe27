"""tools/train_tiny.py --smoke: the files it writes, HF loading, MTP semantics, ortspec conversion."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import ortspec
import reference_mtp
from tools.train_tiny import load_models
from tools.training.checkpoint import MAX_SHARD_BYTES
from tools.training.evaluation import greedy_chains

ROOT = Path(__file__).resolve().parents[1]
SMOKE_SHARD_BYTES = int(0.6 * 2**20)  # --smoke writes small shards so that this test sees several


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("train_tiny") / "ckpt"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "train_tiny.py"), str(out), "--smoke"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_smoke_files(smoke):
    names = {p.name for p in smoke.iterdir()}
    for name in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors.index.json", "eval.json", "train_log.json"]:
        assert name in names
    config = json.loads((smoke / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text"
    assert config["mtp_num_hidden_layers"] == 1
    assert config["eos_token_id"] == 0
    assert not config["tie_word_embeddings"]

    index = json.loads((smoke / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(smoke.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2 and sorted(set(index.values())) == [p.name for p in shards]
    stored = {}
    for path in shards:
        assert path.stat().st_size <= min(SMOKE_SHARD_BYTES, MAX_SHARD_BYTES)
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                stored[key] = path.name
                assert f.get_slice(key).get_dtype() == "F16"
    assert stored == index  # the index covers every key, mtp.* included, and points at its file

    full = [i for i, t in enumerate(config["layer_types"]) if t == "full_attention"][0]
    target_layer = {k[len(f"model.layers.{full}.") :] for k in stored if k.startswith(f"model.layers.{full}.")}
    mtp_layer = {k[len("mtp.layers.0.") :] for k in stored if k.startswith("mtp.layers.0.")}
    assert mtp_layer == target_layer
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight",
            "mtp.pre_fc_norm_hidden.weight", "lm_head.weight", "model.embed_tokens.weight"} <= set(stored)

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(smoke / "tokenizer.json"))
    assert tokenizer.token_to_id("<|endoftext|>") == 0
    assert tokenizer.get_vocab_size() <= config["vocab_size"]

    evaluation = json.loads((smoke / "eval.json").read_text())
    assert evaluation["target"]["loss"] > 0 and evaluation["target"]["perplexity"] > 1
    assert set(evaluation["mtp_acceptance"]["by_k"]) == {"1", "2", "3", "4"}
    for k, row in evaluation["mtp_acceptance"]["by_k"].items():
        assert 0 <= row["mean_accepted"] <= int(k)
    log = json.loads((smoke / "train_log.json").read_text())
    assert log["summary"]["steps"] == 20 and log["log"][-1]["step"] == 20


def test_transformers_loads(smoke):
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

    model, info = Qwen3_5ForCausalLM.from_pretrained(smoke, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    ours, _ = load_models(smoke)
    ids = torch.tensor([[5, 17, 300, 42, 0, 9]])
    with torch.no_grad():
        torch.testing.assert_close(model.float()(ids).logits, ours(ids).logits, atol=1e-4, rtol=1e-4)


def test_mtp_matches_reference(smoke):
    """The head trained and evaluated here is the published MTP the reference (and ortspec) implement."""
    model, mtp = load_models(smoke)
    ids = torch.tensor([3, 250, 11, 98, 7, 1200, 64, 5, 33, 402])
    _, drafts = greedy_chains(model, mtp, ids[None], 4)
    assert drafts[0].tolist() == reference_mtp.reference_drafts(smoke, ids, 4).tolist()
    hidden, _ = reference_mtp.target_hidden_states(smoke, ids[:-1])  # [T, H]
    ref_logits, ref_out = reference_mtp.mtp_reference(smoke)(ids[1:], hidden, torch.arange(len(ids) - 1))
    with torch.no_grad():
        out = mtp(model.model.embed_tokens, ids[None, 1:], hidden[None], torch.arange(len(ids) - 1))[0]
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model.lm_head(out), ref_logits, atol=1e-4, rtol=1e-4)


def test_ortspec_converts_and_speculates(smoke, tmp_path):
    onnx_dir = ortspec.convert(smoke, tmp_path / "onnx", num_speculative_tokens=2, max_length=128, progress=False)
    speculative = ortspec.Session(onnx_dir, num_speculative_tokens=2).generate("def f(", max_new_tokens=8)
    greedy = ortspec.Session(onnx_dir, num_speculative_tokens=0).generate("def f(", max_new_tokens=8)
    assert isinstance(speculative, str)
    assert speculative == greedy
