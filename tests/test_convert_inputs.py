"""Checkpoint contents: each bad one is a typed error naming the problem."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

import ortspec
from tests.small_models import convert_small as convert
from tools.make_tiny_checkpoint import make_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    return make_checkpoint(root / "ck", seed=51)


@pytest.fixture
def copy(checkpoint, tmp_path):
    return shutil.copytree(checkpoint, tmp_path / "ck")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(copy, tmp_path, value):
    tensors = load_file(copy / "model.safetensors")
    tensors["model.layers.2.mlp.down_proj.weight"][5, 7] = value
    save_file(tensors, copy / "model.safetensors")
    with pytest.raises(ortspec.WeightError, match=r"'model.layers.2.mlp.down_proj.weight' has 1 non-finite values "
                                                  r"\(NaN or Inf\), the first at index \[5, 7\]"):
        convert(copy, tmp_path / "out")


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
