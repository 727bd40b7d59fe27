"""The peer harness's export side without the peer: the re-laid checkpoint (exact, loadable by
transformers as Qwen3_5ForConditionalGeneration) and the genai_config variants. The builder's
real output is checked in test_peer_bench.py, where onnxruntime-genai is installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tools.peer import export, relayout

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "tiny-qwen35"


def test_mrope_section_splits_half_the_rotary_dim_in_three():
    assert relayout.mrope_section(16) == [3, 3, 2]  # head_dim 64 x 0.25 (qwen35-python-20m)
    assert relayout.mrope_section(64) == [11, 11, 10]  # head_dim 256 x 0.25 (LARGE)
    assert relayout.mrope_section(8) == [2, 1, 1]
    with pytest.raises(relayout.RelayoutError, match="three M-RoPE sections"):
        relayout.mrope_section(4)


def test_relaid_config_nests_the_text_config():
    config = json.loads((TINY / "config.json").read_text())
    body = relayout.relaid_config(config)
    assert body["architectures"] == ["Qwen3_5ForConditionalGeneration"] and body["model_type"] == "qwen3_5"
    text = body["text_config"]
    assert text["model_type"] == "qwen3_5_text" and "architectures" not in text
    assert text["rope_parameters"]["mrope_section"] == [2, 1, 1] and text["rope_parameters"]["mrope_interleaved"]
    assert body["vision_config"]["out_hidden_size"] == config["hidden_size"]
    assert relayout.relaid_config(body)["text_config"] == text  # an already nested config re-lays the same


def test_relayout_refuses_what_is_not_a_qwen35_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(relayout.RelayoutError, match="not a Qwen3.5 text model"):
        relayout.relay_checkpoint(tmp_path, tmp_path / "out")
    with pytest.raises(relayout.RelayoutError, match="no config.json"):
        relayout.relay_checkpoint(tmp_path / "missing", tmp_path / "out")


@pytest.fixture(scope="module")
def relaid(tmp_path_factory) -> Path:
    return relayout.relay_checkpoint(TINY, tmp_path_factory.mktemp("relaid"))


def test_relaid_weights_are_the_same_bytes_under_nested_names(relaid):
    before, after = load_file(TINY / "model.safetensors"), load_file(relaid / "model.safetensors")
    assert {relayout.nested_name(n) for n in before} == set(after)
    assert any(n.startswith("model.language_model.layers.") for n in after) and any(n.startswith("mtp.") for n in after)
    assert all(torch.equal(t, after[relayout.nested_name(n)]) for n, t in before.items())
    assert (relaid / "tokenizer.json").read_bytes() == (TINY / "tokenizer.json").read_bytes()


def _logits(model_cls, path: Path, ids: torch.Tensor) -> torch.Tensor:
    model = model_cls.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_relaid_checkpoint_loads_as_conditional_generation_with_identical_logits(relaid, tmp_path, monkeypatch):
    """transformers reads the re-laid checkpoint as Qwen3_5ForConditionalGeneration (text
    positions through M-RoPE) and its logits equal Qwen3_5ForCausalLM's on the original,
    bitwise. Planted bug: a re-layout that forgets the renaming loads a random language model."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    ids = torch.tensor([[5, 17, 300, 2, 99, 1000, 7, 8, 9, 10, 11, 12]])
    reference = _logits(Qwen3_5ForCausalLM, TINY, ids)
    assert torch.equal(_logits(Qwen3_5ForConditionalGeneration, relaid, ids), reference)
    monkeypatch.setattr(relayout, "nested_name", lambda name: name)
    broken = relayout.relay_checkpoint(TINY, tmp_path / "broken")
    assert not torch.allclose(_logits(Qwen3_5ForConditionalGeneration, broken, ids), reference, atol=1e-3)


GENAI = {
    "model": {
        "type": "qwen3_5_text", "eos_token_id": 0, "vocab_size": 1024, "context_length": 4096,
        "decoder": {"session_options": {"log_id": "x", "provider_options": [{"cuda": {"enable_cuda_graph": "0"}}]},
                    "filename": "model.onnx", "head_size": 32, "hidden_size": 128, "num_attention_heads": 4,
                    "num_hidden_layers": 4, "num_key_value_heads": 2, "inputs": {"input_ids": "input_ids"},
                    "outputs": {"logits": "logits", "hidden_states": "hidden_states"},
                    "shared_initializers": [{"name": "model.embed_tokens.weight"}]},
        "mtp": {"enabled": True, "filename": "mtp.onnx", "num_hidden_layers": 1, "num_key_value_heads": 2,
                "head_size": 32, "main_hidden_states": "hidden_states",
                "inputs": {"input_ids": "input_ids", "hidden_states": "hidden_states"},
                "outputs": {"logits": "logits", "hidden_states": "hidden_states_out"},
                "shared_initializers": [{"name": "model.embed_tokens.weight"}]},
    },
    "search": {"do_sample": False, "max_length": 4096},
}


def test_head_config_is_the_mtp_section_as_a_one_layer_decoder():
    head = export.head_config(GENAI)
    decoder = head["model"]["decoder"]
    assert set(decoder) <= set(export.DECODER_KEYS) | {"num_hidden_layers"}  # genai refuses unknown keys
    assert decoder["filename"] == "mtp.onnx" and decoder["num_hidden_layers"] == 1
    assert decoder["inputs"]["hidden_states"] == "hidden_states" and decoder["num_attention_heads"] == 4
    assert decoder["session_options"] == GENAI["model"]["decoder"]["session_options"]
    assert head["model"]["type"] == "qwen3_5_text" and "mtp" not in head["model"] and head["search"] == GENAI["search"]
    with pytest.raises(export.PeerExportError, match="no 'mtp' section"):
        export.head_config({"model": {"decoder": {}}, "search": {}})


def test_graph_and_cpu_variants_change_only_their_options():
    graph = export.graph_config(GENAI)
    assert graph["model"]["decoder"]["session_options"]["provider_options"] == [{"cuda": {"enable_cuda_graph": "1"}}]
    assert GENAI["model"]["decoder"]["session_options"]["provider_options"][0]["cuda"]["enable_cuda_graph"] == "0"
    cpu = export.cpu_config(GENAI)
    assert cpu["model"]["decoder"]["session_options"]["provider_options"] == []
    assert "shared_initializers" not in cpu["model"]["decoder"] and "shared_initializers" not in cpu["model"]["mtp"]
    assert cpu["model"]["decoder"]["inputs"] == GENAI["model"]["decoder"]["inputs"]


def test_builder_failure_is_reported_with_its_log(tmp_path, monkeypatch):
    monkeypatch.setattr(export, "BUILDER_MODULE", "ortspec_no_such_builder")
    with pytest.raises(export.PeerExportError, match="(?s)builder failed.*No module named"):
        export.export_peer(TINY, tmp_path, "cuda")
    assert not (tmp_path / "peer").exists()
