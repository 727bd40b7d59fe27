"""convert's arguments and checkpoint contents: each bad one is a typed error naming the
problem, raised before any work where it can be, and leaving nothing on disk."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import ortspec
from ortspec.converter.options import check_max_length, request_bytes
from ortspec.model_spec import ModelSpec
from tests.small_models import convert_small as convert
from tools.make_tiny_checkpoint import make_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    return make_checkpoint(root / "ck", seed=51)


@pytest.fixture
def copy(checkpoint, tmp_path):
    return shutil.copytree(checkpoint, tmp_path / "ck")


@pytest.mark.parametrize("option,match", [
    (dict(num_speculative_tokens="4"), r"num_speculative_tokens='4' must be an integer, not str \(pass it without"),
    (dict(num_speculative_tokens=True), "num_speculative_tokens=True must be an integer"),
    (dict(max_length=1.5), "max_length=1.5 must be an integer, not float"),
    (dict(pipeline_stages="2"), "pipeline_stages='2' must be an integer"),
    (dict(pipeline_stages=0), "pipeline_stages=0 must be at least 1"),
    (dict(stage_layers="0,2,4"), "stage_layers='0,2,4' must be a list"),
    (dict(stage_layers=[0, "2", 4]), "stage_layers='2' must be an integer"),
    (dict(dtype=16), "dtype 16 is not supported"),
    (dict(quant="INT4"), "quant='INT4' is not supported"),
    (dict(overwrite="no"), "overwrite='no' must be True or False"),
    (dict(max_length=1), "max_length=1 is too small"),
    (dict(gdn_verify="windows"), "gdn_verify='windows' is not supported; use one of 'per_row', 'state_window'"),
    (dict(gdn_verify="state_window", num_speculative_tokens=8),
     r"the ops' state_window holds at most 8 rows, a verify of k=8 has 9. Use num_speculative_tokens <= 7"),
])
def test_bad_option_types_are_refused_before_reading_anything(tmp_path, option, match):
    with pytest.raises(ortspec.ConvertOptionError, match=match) as error:
        convert(tmp_path / "no-such-checkpoint", tmp_path / "out", **option)
    assert isinstance(error.value, ortspec.CheckpointError) and isinstance(error.value, ortspec.ConfigurationError)
    assert not (tmp_path / "out").exists()


def test_bad_paths_and_numpy_integers(checkpoint, tmp_path):
    with pytest.raises(ortspec.ConvertOptionError, match="out_dir=5 must be a path"):
        convert(checkpoint, 5)
    out = convert(checkpoint, tmp_path / "out", num_speculative_tokens=np.int64(1), max_length=np.int32(32))
    assert json.loads((out / "manifest.json").read_text())["max_length"] == 32


def test_max_length_beyond_max_position_embeddings(checkpoint, tmp_path):
    with pytest.raises(ortspec.ConvertOptionError, match="max_length=5000 exceeds max_position_embeddings=4096.*"
                                                        "--max-length 4096"):
        convert(checkpoint, tmp_path / "out", max_length=5000)


def test_max_length_that_cannot_fit_in_memory_is_refused_at_once(copy, tmp_path):
    """Used to precompute RoPE tables of 10**9 rows and get OOM-killed; now a message saying how much."""
    config = json.loads((copy / "config.json").read_text())
    del config["max_position_embeddings"]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ortspec.ConvertOptionError, match=r"max_length=1000000000 needs [\d,.]+ GiB .* this machine "
                                                        r"has [\d,.]+ GiB of memory\. Use --max-length \d+ or less"):
        convert(copy, tmp_path / "out", max_length=10**9)
    assert list(tmp_path.glob(".out*")) == [] and not (tmp_path / "out").exists()


def test_the_memory_bound_is_exact(checkpoint):
    spec = ModelSpec.from_checkpoint(checkpoint)
    memory = request_bytes(spec, 100, True)
    check_max_length(spec, 100, True, memory=memory)
    with pytest.raises(ortspec.ConvertOptionError, match="Use --max-length 100 or less"):
        check_max_length(spec, 101, True, memory=memory)
    # one request: a KV cache [kvh, hd, L] + [kvh, L, hd] fp32 per attention layer and the MTP head, plus tables
    per_token = 2 * (len(spec.layers_of("full_attention")) + 1) * spec.num_key_value_heads * spec.head_dim * 4
    assert request_bytes(spec, 2, True) - request_bytes(spec, 1, True) == per_token + 2 * 4 * spec.rotary_dim // 2 + 32


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(copy, tmp_path, value):
    tensors = load_file(copy / "model.safetensors")
    tensors["model.layers.2.mlp.down_proj.weight"][5, 7] = value
    save_file(tensors, copy / "model.safetensors")
    with pytest.raises(ortspec.WeightError, match=r"'model.layers.2.mlp.down_proj.weight' has 1 non-finite values "
                                                  r"\(NaN or Inf\), the first at index \[5, 7\]"):
        convert(copy, tmp_path / "out")
    assert list(tmp_path.glob(".out*")) == [] and not (tmp_path / "out").exists()


def test_a_nan_bfloat16_weight_over_an_existing_model_leaves_it_intact(tmp_path):
    make_checkpoint(tmp_path / "ck", seed=52, dtype="bfloat16")
    out = convert(tmp_path / "ck", tmp_path / "out")
    tensors = load_file(tmp_path / "ck" / "model.safetensors")
    tensors["mtp.fc.weight"][0, 0] = torch.nan
    save_file(tensors, tmp_path / "ck" / "model.safetensors")
    with pytest.raises(ortspec.WeightError, match="'mtp.fc.weight' has 1 non-finite"):
        convert(tmp_path / "ck", out, overwrite=True)
    ortspec.verify(out)
    assert list(tmp_path.glob(".out*")) == []


def test_a_truncated_safetensors_file_is_a_checkpoint_error(copy, tmp_path):
    path = copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ortspec.CheckpointError, match=r"model\.safetensors cannot be read as safetensors .* cut short"):
        convert(copy, tmp_path / "out")


def test_a_truncated_shard_is_found_before_any_work(tmp_path):
    make_checkpoint(tmp_path / "ck", seed=53, shards=2)
    shard = tmp_path / "ck" / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:40])
    with pytest.raises(ortspec.CheckpointError, match=r"model-00002-of-00002\.safetensors cannot be read"):
        convert(tmp_path / "ck", tmp_path / "out")
    (tmp_path / "ck" / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(ortspec.CheckpointError, match=r"index\.json cannot be read as a safetensors index"):
        convert(tmp_path / "ck", tmp_path / "out")
    assert not (tmp_path / "out").exists()
