"""Checkpoints that would convert into a wrong model, or into a raw exception (issue 21): each is
refused with a typed error naming the file and the key, and nothing is written."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import ortspec
from ortspec import cli
from ortspec.errors import CheckpointError, ModelDirError, WeightError
from tests.small_models import convert_small as convert
from tools.make_tiny_checkpoint import make_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("hostile") / "ck", seed=61, tokenizer=True)


@pytest.fixture
def copy(checkpoint, tmp_path):
    return shutil.copytree(checkpoint, tmp_path / "ck")


def edit_tensors(ck, edit) -> None:
    tensors = load_file(ck / "model.safetensors")
    edit(tensors)
    save_file(tensors, ck / "model.safetensors")


def refused(ck, tmp_path, error, match) -> None:
    with pytest.raises(error, match=match):
        convert(ck, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_untied_embeddings_without_lm_head_are_refused(copy, tmp_path):
    edit_tensors(copy, lambda t: t.pop("lm_head.weight"))
    refused(copy, tmp_path, WeightError, r"config\.json has tie_word_embeddings=false but the checkpoint has no "
                                         r"'lm_head\.weight'")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool])
def test_a_non_floating_weight_is_refused(copy, tmp_path, dtype):
    key = "model.layers.0.mlp.up_proj.weight"
    edit_tensors(copy, lambda t: t.update({key: (t[key] * 100).to(dtype)}))
    refused(copy, tmp_path, WeightError, rf"weight '{key}' in model\.safetensors has dtype "
                                         rf"{str(dtype).removeprefix('torch.')}, not a floating-point dtype")


@pytest.mark.parametrize("content", [b"not json", b'{"version": "1.0"}', b"[1, 2]"])
def test_a_tokenizer_json_that_does_not_load_is_refused(copy, tmp_path, content):
    (copy / "tokenizer.json").write_bytes(content)
    refused(copy, tmp_path, CheckpointError, r"tokenizer\.json does not load as a tokenizer")


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(copy, tmp_path):
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "vocab_size": 300}))
    refused(copy, tmp_path, CheckpointError, r"tokenizer\.json has 512 tokens but config\.json's vocab_size is 300")


def test_a_tokenizer_config_that_is_not_an_object_is_refused(copy, tmp_path):
    (copy / "tokenizer_config.json").write_text("[]")
    refused(copy, tmp_path, CheckpointError, r"tokenizer_config\.json is a JSON list; it must be an object")


@pytest.fixture
def sharded(tmp_path):
    return make_checkpoint(tmp_path / "sharded", seed=62, shards=2)


def edit_index(ck, edit) -> None:
    path = ck / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    path.write_text(json.dumps(edit(index)))


@pytest.mark.parametrize("edit,match", [
    (lambda i: {**i, "weight_map": {**i["weight_map"], "model.norm.weight": 7}},
     r"weight_map\['model\.norm\.weight'\] is 7, not the name of a shard file"),
    (lambda i: {**i, "weight_map": {**i["weight_map"], "model.norm.weight": "../elsewhere.safetensors"}},
     r"weight_map\['model\.norm\.weight'\] is \"\.\./elsewhere\.safetensors\", not the name"),
    (lambda i: {**i, "weight_map": {**i["weight_map"], "model.norm.weight": None}}, r"is null, not the name"),
    (lambda i: {**i, "weight_map": [1, 2]}, r"has no 'weight_map' object"),
    (lambda i: [i], r"has no 'weight_map' object"),
])
def test_a_malformed_index_is_refused_naming_the_key(sharded, tmp_path, edit, match):
    edit_index(sharded, edit)
    refused(sharded, tmp_path, CheckpointError, r"model\.safetensors\.index\.json.*" + match)


def edit_config(ck, edit) -> None:
    path = ck / "config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


@pytest.mark.parametrize("edit,match", [
    (lambda c: [c], r"config\.json is a JSON list; it must be an object"),
    (lambda c: "qwen", r"config\.json is a JSON str"),
    (lambda c: {**c, "hidden_size": "128"}, r"config\.json has hidden_size=\"128\", a string; it must be an integer "
                                            r"\(without quotes\)"),
    (lambda c: {**c, "hidden_size": 64.0}, r"hidden_size=64\.0, a float; it must be an integer"),
    (lambda c: {**c, "num_key_value_heads": 0}, r"num_key_value_heads=0; it must be an integer in \[1, "),
    (lambda c: {**c, "vocab_size": 10**30}, r"vocab_size=1000000000000000000000000000000; it must be an integer in"),
    (lambda c: {**c, "tie_word_embeddings": "false"}, r"tie_word_embeddings=\"false\", a string; it must be true or "
                                                      r"false"),
    (lambda c: {**c, "layer_types": "linear_attention"}, r"layer_types=\"linear_attention\"; it must be a list of"),
    (lambda c: {**c, "rms_norm_eps": "1e-6"}, r"rms_norm_eps=\"1e-6\", a string; it must be a number"),
    (lambda c: {**c, "rms_norm_eps": -1}, r"rms_norm_eps=-1; it must be a finite number with rms_norm_eps > 0"),
    (lambda c: {**c, "rope_parameters": ["default"]}, r"rope_parameters=\[\"default\"\]; it must be an object"),
    (lambda c: {**c, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 2}},
     r"partial_rotary_factor=2; it must be a finite number with 0 < partial_rotary_factor <= 1"),
    (lambda c: {**c, "eos_token_id": "eos"}, r"eos_token_id=\"eos\"; it must be a token id"),
    (lambda c: {**c, "model_type": ["qwen3_5_text"]}, r"model_type \['qwen3_5_text'\] is not supported"),
    (lambda c: {**c, "model_type": "qwen3_5", "text_config": "x"}, r"text_config=\"x\"; it must be an object"),
])
def test_a_malformed_config_is_refused_naming_the_key(copy, tmp_path, edit, match):
    edit_config(copy, edit)
    refused(copy, tmp_path, CheckpointError, match)


def test_verify_names_a_weights_file_that_is_a_directory(checkpoint, tmp_path, capsys):
    model = convert(checkpoint, tmp_path / "model")
    (model / "weights.bin").unlink()
    (model / "weights.bin").mkdir()
    with pytest.raises(ModelDirError, match=r"weights\.bin is not a file \(a directory or a device\)"):
        ortspec.verify(model)
    assert cli.main(["verify", str(model)]) == 2
    assert "is not a file" in capsys.readouterr().err


def test_bench_refuses_batch_0_naming_the_option(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["bench", str(tmp_path), "--batch", "1,0"])
    assert exit.value.code == 2
    assert "argument --batch: batch sizes must be integers >= 1" in capsys.readouterr().err
