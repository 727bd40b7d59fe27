"""Greedy parity with transformers' Qwen3_5ForCausalLM, token for token.

ortspec's greedy tokens are checked teacher-forced: transformers runs over prompt + ortspec's
output, and at every generated position ortspec's token must be transformers' argmax, unless
transformers' top-2 logits there are within 1e-4 (a near-tie, where fp32 rounding may pick either).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import ortspec
from tools.make_tiny_checkpoint import make_checkpoint

NEAR_TIE = 1e-4


def hf_model(checkpoint):
    from transformers import Qwen3_5ForCausalLM

    return Qwen3_5ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def assert_matches_transformers(model, prompt, generated):
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1: -1]  # predictions for each generated token
    top2 = torch.topk(logits, 2, dim=-1)
    for i, token in enumerate(generated):
        if token != int(top2.indices[i, 0]):
            gap = float(top2.values[i, 0] - top2.values[i, 1])
            assert gap < NEAR_TIE and token == int(top2.indices[i, 1]), (
                f"token {i}: ortspec {token}, transformers {int(top2.indices[i, 0])} (top-2 gap {gap:.2e})")


def prompts_for(vocab, lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("config", ["base", "attn_first", "mixed"])
def test_greedy_matches_transformers(models, config):
    session = ortspec.Session(models.converted(config))
    model = hf_model(models.checkpoint(config))
    vocab = session.manifest.spec.vocab_size
    prompts = prompts_for(vocab, [1, 2, 9, 33, 64], seed=hash(config) % 1000)
    outputs = session.generate(prompts, max_new_tokens=40)
    for prompt, out in zip(prompts, outputs):
        assert len(out) == 40
        assert_matches_transformers(model, prompt, out)


def random_config(rng: random.Random) -> dict:
    """Dimensions and layer orders drawn at random, within what the family allows."""
    num_layers = rng.randint(2, 5)
    layer_types = [rng.choice(["linear_attention", "full_attention"]) for _ in range(num_layers)]
    layer_types[rng.randrange(num_layers)] = "linear_attention"
    layer_types[rng.randrange(num_layers)] = "full_attention"
    kv_heads = rng.choice([1, 2])
    nk = rng.choice([1, 2])
    head_dim = rng.choice([8, 16, 32])
    return dict(
        seed=rng.randrange(10_000),
        hidden_size=rng.choice([32, 48, 64]),
        intermediate_size=rng.choice([40, 64, 96]),
        vocab_size=rng.choice([128, 300]),
        layer_types=tuple(layer_types),
        num_attention_heads=kv_heads * rng.choice([1, 2, 3]),
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        partial_rotary_factor=rng.choice([0.25, 0.5, 1.0]),
        linear_num_key_heads=nk,
        linear_num_value_heads=nk * rng.choice([1, 2]),
        linear_key_head_dim=rng.choice([8, 16]),
        linear_value_head_dim=rng.choice([8, 16, 24]),
        linear_conv_kernel_dim=rng.choice([2, 4]),
        tie_word_embeddings=rng.random() < 0.3,
        rope_theta=rng.choice([10000.0, 1e6]),
    )


@pytest.mark.parametrize("seed", [11, 12, 13, 14])
def test_random_configs_match_transformers(tmp_path, seed):
    config = random_config(random.Random(seed))
    make_checkpoint(tmp_path / "ck", **config)
    ortspec.convert(tmp_path / "ck", tmp_path / "out", num_speculative_tokens=2, max_length=128, progress=False)
    session = ortspec.Session(tmp_path / "out")
    prompts = prompts_for(config["vocab_size"], [1, 5, 20], seed)
    outputs = session.generate(prompts, max_new_tokens=32)
    model = hf_model(tmp_path / "ck")
    for prompt, out in zip(prompts, outputs):
        assert_matches_transformers(model, prompt, out)
    spec_out = ortspec.Session(tmp_path / "out", num_speculative_tokens=2).generate(prompts, max_new_tokens=32)
    assert spec_out == outputs


def test_prefill_logits_close_to_transformers(models):
    """fp32 tolerance on the logits themselves, not only the argmax."""
    session = ortspec.Session(models.converted("base"))
    model = hf_model(models.checkpoint("base"))
    prompt = prompts_for(session.manifest.spec.vocab_size, [24], 0)[0]
    from ortspec.runtime.model import TargetModel
    from ortspec.runtime.states import Rows

    out = TargetModel(session.graphs, 1).prefill(Rows([0]), np.array([prompt]), np.arange(24)[None])
    with torch.no_grad():
        ref = model(torch.tensor([prompt]), output_hidden_states=True)
    assert out["logits"].shape == (1, 1, session.manifest.spec.vocab_size)  # the prompt's last row alone
    np.testing.assert_allclose(out["logits"][0], ref.logits[0, -1:].numpy(), atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(out["hidden"][0], ref.hidden_states[-1][0].numpy(), atol=2e-4, rtol=1e-4)
