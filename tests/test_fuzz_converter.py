"""Fuzzing convert's parsing of config.json and model.safetensors.index.json (issue 21):
hypothesis replaces fields of a real config (and whole documents) with any JSON, and draws
weight maps of any shape. Each parse gives a ModelSpec whose every field has its type, or a
CheckpointError; never another exception. Bounded: a second or two."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from ortspec.converter.checkpoint import CheckpointReader
from ortspec.errors import CheckpointError
from ortspec.model_spec import ModelSpec
from tools.make_tiny_checkpoint import make_checkpoint

SETTINGS = settings(max_examples=300, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-3, 600), st.sampled_from([0, 2**31, 2**63, 10**30]),
                      st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                      st.sampled_from(["qwen3_5_text", "qwen3_5", "linear_attention", "full_attention", "default"]))
json_any = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=6), inner, max_size=4), max_leaves=8)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> dict:
    ck = make_checkpoint(tmp_path_factory.mktemp("fuzz") / "ck", seed=71)
    return json.loads((ck / "config.json").read_text())


def spec_is_typed(spec: ModelSpec) -> None:
    for field in dataclasses.fields(spec):
        value = getattr(spec, field.name)
        if field.name == "layer_types":
            assert value and all(kind in ("linear_attention", "full_attention") for kind in value)
        elif field.name == "eos_token_ids":
            assert all(type(i) is int and i >= 0 for i in value)
        elif field.name == "max_position_embeddings":
            assert value is None or (type(value) is int and value >= 1)
        elif field.type in ("int", int):
            assert type(value) is int and value >= 0, field.name
        elif field.type in ("float", float):
            assert type(value) is float and value > 0 and value != float("inf"), field.name
        elif field.type in ("bool", bool):
            assert type(value) is bool, field.name


@SETTINGS
@given(changes=st.dictionaries(st.sampled_from(
    ["hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers", "layer_types", "num_attention_heads",
     "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
     "linear_value_head_dim", "linear_conv_kernel_dim", "rms_norm_eps", "rope_theta", "rope_parameters",
     "partial_rotary_factor", "tie_word_embeddings", "mtp_num_hidden_layers", "eos_token_id", "model_type",
     "max_position_embeddings", "full_attention_interval", "text_config", "attention_bias", "hidden_act",
     "num_experts"]), json_any, max_size=3), drop=st.lists(st.sampled_from(
        ["hidden_size", "layer_types", "vocab_size", "rope_parameters", "num_hidden_layers"]), max_size=2))
def test_config_fields_of_any_json_give_a_typed_spec_or_a_checkpoint_error(config, changes, drop):
    document = {key: value for key, value in {**config, **changes}.items() if key not in drop}
    try:
        spec = ModelSpec.from_hf_config(document)
    except CheckpointError:
        return
    spec_is_typed(spec)


@SETTINGS
@given(document=json_any)
def test_any_json_document_as_config_gives_a_spec_or_a_checkpoint_error(document):
    try:
        spec = ModelSpec.from_hf_config(document)
    except CheckpointError:
        return
    spec_is_typed(spec)


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("index")
    save_file({"model.embed_tokens.weight": torch.zeros(4, 2)}, root / "a.safetensors")
    return root


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(index=st.one_of(
    json_any,
    st.fixed_dictionaries({"weight_map": st.dictionaries(
        st.sampled_from(["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]),
        st.one_of(st.just("a.safetensors"), st.sampled_from(["missing.safetensors", "../a.safetensors", "", "/a"]),
                  json_any), max_size=3)}),
    st.fixed_dictionaries({"weight_map": json_any})))
def test_an_index_of_any_shape_is_read_or_a_checkpoint_error(shard_dir, index):
    with tempfile.TemporaryDirectory(dir=shard_dir) as scratch:
        ck = Path(scratch)
        (ck / "a.safetensors").symlink_to(shard_dir / "a.safetensors")
        (ck / "model.safetensors.index.json").write_text(json.dumps(index, allow_nan=True))
        try:
            reader = CheckpointReader(ck)
        except CheckpointError:
            return
        assert reader.has("embed_tokens.weight")
