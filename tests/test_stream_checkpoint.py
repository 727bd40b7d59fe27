"""tools/stream_checkpoint.py: a checkpoint written tensor by tensor equals make_checkpoint's,
and its Qwen3.5-0.8B preset has that model's shape (checked from the plan alone: no tensor drawn)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from ortspec.model_spec import FULL, ModelSpec
from tools.gpu_suite import common
from tools.make_tiny_checkpoint import build_config, make_checkpoint
from tools.stream_checkpoint import QWEN35_08B, safetensors_header, tensor_plan, write_random_checkpoint


@pytest.mark.parametrize("dims", [{}, dict(tie_word_embeddings=True, layer_types=("linear_attention", "full_attention"))])
def test_streamed_checkpoint_equals_make_checkpoint(tmp_path, dims):
    made = make_checkpoint(tmp_path / "made", seed=5, dtype="float16", **dims)
    streamed = write_random_checkpoint(tmp_path / "streamed", seed=5, dtype="float16", **dims)
    a, b = load_file(str(made / "model.safetensors")), load_file(str(streamed / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[name], b[name]) for name in a)
    assert json.loads((made / "config.json").read_text()) == json.loads((streamed / "config.json").read_text())
    assert not list(streamed.glob("*.partial"))


def test_qwen35_08b_preset_has_the_published_shape():
    config = build_config(mtp=True, dtype="float16", **QWEN35_08B)
    spec = ModelSpec.from_hf_config(config.to_dict())
    assert (spec.hidden_size, spec.num_layers, spec.vocab_size, spec.tie_word_embeddings) == (1024, 24, 248320, True)
    assert spec.layers_of(FULL) == [3, 7, 11, 15, 19, 23] and spec.mtp_num_hidden_layers == 1
    plan = tensor_plan(config)
    params = sum(p.numel() for _, p, _, _ in plan)
    embedding = next(p for name, p, _, _ in plan if name == "model.embed_tokens.weight")
    assert 0.75e9 < params < 0.85e9 and embedding.shape == (248320, 1024)
    assert "lm_head.weight" not in [name for name, *_ in plan]  # tied: stored once
    header = safetensors_header(plan, "float16")
    length = int.from_bytes(header[:8], "little")
    entries = json.loads(header[8:8 + length])
    assert len(header) % 8 == 0 and entries["model.embed_tokens.weight"]["data_offsets"][1] - \
        entries["model.embed_tokens.weight"]["data_offsets"][0] == 2 * 248320 * 1024
    assert "qwen35-0.8b" in common.STREAMED


def test_build_large_builds_a_streamed_preset(tmp_path, monkeypatch):
    """tools/gpu.py agree --preset: the streamed checkpoint written and converted (here a tiny
    shape in the preset's place), with the draft vocabulary asked for recorded."""
    from ortspec.manifest import Manifest
    from tools.gpu_suite import scale

    monkeypatch.setitem(common.STREAMED, "qwen35-0.8b", (dict(vocab_size=512), dict(seed=0, dtype="float16")))
    model = scale.build_large(tmp_path, dtype="float32", preset="qwen35-0.8b", draft_vocab=128)
    assert model == tmp_path / "qwen35-0.8b_float32" and (tmp_path / "qwen35-0.8b_ck" / "model.safetensors").exists()
    assert Manifest.load(model).draft_vocab["size"] == 128
