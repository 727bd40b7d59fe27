"""The converter: layouts it reads, what it writes, and the errors it gives."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest
from safetensors.torch import load_file, save_file

import ortspec
from ortspec.manifest import Manifest
from ortspec.runtime.graphs import GraphSet
from tools.make_tiny_checkpoint import make_checkpoint

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7]]


def convert(ck, out, **kw):
    kw.setdefault("num_speculative_tokens", 2)
    kw.setdefault("max_length", 64)
    return ortspec.convert(ck, out, progress=False, **kw)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """One checkpoint in the plain layout and its greedy outputs, to compare other layouts with."""
    root = tmp_path_factory.mktemp("plain")
    make_checkpoint(root / "ck", seed=21, tokenizer=True)
    convert(root / "ck", root / "out")
    return root, ortspec.Session(root / "out").generate(PROMPTS, max_new_tokens=16)


@pytest.mark.parametrize("layout", [dict(nested=True), dict(shards=3), dict(nested=True, shards=2)])
def test_other_layouts_give_the_same_model(plain, tmp_path, layout):
    _, expected = plain
    make_checkpoint(tmp_path / "ck", seed=21, **layout)
    convert(tmp_path / "ck", tmp_path / "out")
    assert ortspec.Session(tmp_path / "out").generate(PROMPTS, max_new_tokens=16) == expected
    assert ortspec.Session(tmp_path / "out", num_speculative_tokens=2).generate(PROMPTS, max_new_tokens=16) == expected


def test_bfloat16_checkpoint_and_float16_weights(plain, tmp_path):
    root, _ = plain
    make_checkpoint(tmp_path / "ck", seed=21, dtype="bfloat16")
    convert(tmp_path / "ck", tmp_path / "out")
    assert len(ortspec.Session(tmp_path / "out").generate(PROMPTS[0], max_new_tokens=8)) == 8
    convert(root / "ck", tmp_path / "half", dtype="float16")
    size = lambda d: (d / "weights.bin").stat().st_size  # noqa: E731
    assert size(tmp_path / "half") < 0.7 * size(root / "out")
    out = ortspec.Session(tmp_path / "half", num_speculative_tokens=2).generate(PROMPTS, max_new_tokens=8)
    assert out == ortspec.Session(tmp_path / "half").generate(PROMPTS, max_new_tokens=8)


def test_low_precision_compute(plain, tmp_path):
    """float16: products in fp16, states fp32, speculative still bitwise exact on the CPU;
    bfloat16: refused on the CPU with a clear message."""
    import onnx

    from ortspec.runtime.graphs import GraphSet
    from ortspec.speculative.exactness import check_speculative

    root, _ = plain
    convert(root / "ck", tmp_path / "f16", dtype="float16")
    m = Manifest.load(tmp_path / "f16")
    assert m.dtype == "float16" and all(e["dtype"] == "float32" for e in m.states.values())
    decode = onnx.load(str(tmp_path / "f16" / "decode.onnx"), load_external_data=False)
    low = {i.name for i in decode.graph.initializer if i.data_type == onnx.TensorProto.FLOAT16}
    # the default activations (auto) put a float16 model's stream norms in float16 too; the GDN's own stay float32
    assert "lm_head" in low and "L0.in_proj" in low and "L0.in_norm" in low and "L0.decay_scale" not in low
    check_speculative(GraphSet(m), PROMPTS, 24, 2, "readvance", p=0.6)
    convert(root / "ck", tmp_path / "bf16", dtype="bfloat16")
    with pytest.raises(ortspec.ConfigurationError, match="provider='cuda' only"):
        ortspec.Session(tmp_path / "bf16")


def test_int4_weights(plain, tmp_path):
    """--quant int4: MatMulNBits blocks of 32, a bounded quantization error, and speculative
    decoding still bitwise exact on the CPU (accuracy_level 4 is row-invariant)."""
    import onnx

    from ortspec.converter.quantize import dequantize_int4, quantize_int4
    from ortspec.runtime.graphs import GraphSet
    from ortspec.speculative.exactness import check_speculative

    w = np.random.default_rng(0).standard_normal((80, 24)).astype(np.float32)  # K=80: a padded last block
    packed, scales = quantize_int4(w)
    assert packed.shape == (24, 3, 16) and packed.dtype == np.uint8 and scales.shape == (72,)
    block_max = np.abs(np.pad(w, ((0, 16), (0, 0))).T.reshape(24, 3, 32)).max(axis=2)
    error = np.abs(dequantize_int4(packed, scales, 80) - w).T.reshape(24, -1)
    assert np.all(error <= np.repeat(block_max / 14 + 1e-7, 32, axis=1)[:, :80])  # half a step

    root, _ = plain
    convert(root / "ck", tmp_path / "q4", quant="int4")
    m = Manifest.load(tmp_path / "q4")
    assert m.quant == "int4"
    ops = [n.op_type for n in onnx.load(str(tmp_path / "q4" / "decode.onnx"), load_external_data=False).graph.node]
    assert ops.count("MatMulNBits") >= 10 and "Gather" in ops
    assert (tmp_path / "q4" / "weights.bin").stat().st_size < 0.5 * (root / "out" / "weights.bin").stat().st_size
    for commit in ("select", "readvance"):
        check_speculative(GraphSet(m), PROMPTS, 24, 2, commit, p=0.6)
    convert(root / "ck", tmp_path / "q4h", quant="int4", dtype="float16")  # int4 blocks stay uint8
    decode = onnx.load(str(tmp_path / "q4h" / "decode.onnx"), load_external_data=False)
    types = {i.name: i.data_type for i in decode.graph.initializer}
    assert types["L0.in_proj"] == onnx.TensorProto.UINT8 and types["embed"] == onnx.TensorProto.FLOAT16
    assert len(ortspec.Session(tmp_path / "q4h", num_speculative_tokens=2).generate(PROMPTS[0], max_new_tokens=6)) == 6


def test_int4_draft_head_only(plain, tmp_path):
    """--mtp-quant int4: the MTP head (with its own lm_head copy) runs MatMulNBits, the target
    keeps float32; speculative output is still the target's greedy and states stay exact."""
    import onnx

    from ortspec.runtime.graphs import GraphSet
    from ortspec.speculative.exactness import check_speculative

    root, _ = plain
    convert(root / "ck", tmp_path / "mq", mtp_quant="int4")
    m = Manifest.load(tmp_path / "mq")
    assert (m.quant, m.mtp_quant) == (None, "int4")

    def ops(graph):
        return [n.op_type for n in onnx.load(str(tmp_path / "mq" / f"{graph}.onnx"), load_external_data=False).graph.node]

    assert "MatMulNBits" not in ops("decode") + ops("verify_select_k2")
    assert "MatMul" not in ops("mtp_propose_k2") and ops("mtp_propose_k2").count("MatMulNBits") >= 7
    assert "mtp.lm_head" in m.graphs["mtp_propose_k2"]["weights"] and "lm_head" not in m.graphs["mtp_propose_k2"]["weights"]
    greedy = ortspec.Session(root / "out").generate(PROMPTS, max_new_tokens=16)
    assert ortspec.Session(tmp_path / "mq", num_speculative_tokens=2).generate(PROMPTS, max_new_tokens=16) == greedy
    check_speculative(GraphSet(m), PROMPTS, 24, 2, "select", p=0.6)
    with pytest.raises(ortspec.CheckpointError, match="mtp_quant='int8' is not supported"):
        convert(root / "ck", tmp_path / "bad", mtp_quant="int8")


def test_draft_head_quant_default_follows_the_dtype(plain, tmp_path):
    """mtp_quant="auto" (the default): a float32 model gets the int4 draft head (cheaper drafts on
    the CPU), a float16 one keeps its head in float16; "none" keeps float32; the output is the
    target's greedy either way."""
    root, _ = plain
    assert Manifest.load(root / "out").mtp_quant == "int4"
    convert(root / "ck", tmp_path / "none", mtp_quant="none")
    convert(root / "ck", tmp_path / "fp16", dtype="float16")
    assert Manifest.load(tmp_path / "none").mtp_quant is None and Manifest.load(tmp_path / "fp16").mtp_quant is None
    greedy = ortspec.Session(tmp_path / "none").generate(PROMPTS, max_new_tokens=12)
    assert ortspec.Session(root / "out", num_speculative_tokens=2).generate(PROMPTS, max_new_tokens=12) == greedy
    with pytest.raises(ortspec.CheckpointError, match="use 'auto'"):
        convert(root / "ck", tmp_path / "bad", mtp_quant="int2")


def test_manifest_describes_graphs_and_states(plain):
    root, _ = plain
    m = Manifest.load(root / "out")
    assert m.num_speculative_tokens == 2 and m.max_length == 64
    assert set(m.graphs) == {"prefill", "decode", "decode_sample", "sample_logits", "verify_k1", "verify_k2", "verify_select_k1",
                             "verify_select_k2", "mtp", "mtp_propose_k1", "mtp_propose_k2", "mtp_sample_k1",
                             "mtp_sample_k2", "verify_mtp_k1", "verify_mtp_k2", "verify_mtp_sample_k1",
                             "verify_mtp_sample_k2"}
    kinds = {e["kind"] for e in m.states.values()}
    assert kinds == {"kv_key", "kv_value", "conv", "recurrent", "mtp_kv_key", "mtp_kv_value"}
    assert all(e["dtype"] == "float32" for e in m.states.values())
    spec = m.spec
    for i in spec.layers_of("linear_attention"):
        assert m.states[f"recurrent.{i}"]["shape"][1:] == [spec.linear_num_value_heads, spec.linear_key_head_dim,
                                                            spec.linear_value_head_dim]
    assert "tokenizer.json" in m.tokenizer_files and (root / "out" / "tokenizer.json").is_file()
    doc = json.loads((root / "out" / "manifest.json").read_text())
    assert doc["weights"]["file"] == "weights.bin"


SAMPLING_FEEDS = {"temperature": lambda shape: np.array([1.0, 0.0], np.float32),
                  "top_k": lambda shape: np.array([5, 0]), "top_p": lambda shape: np.array([0.9, 1.0], np.float32),
                  "min_p": lambda shape: np.array([0.01, 0.0], np.float32),
                  "uniforms": lambda shape: np.full((2, shape[1]), 0.5, np.float32),
                  "draft_probs": lambda shape: np.full((2, *shape[1:]), 1 / shape[2], np.float32)}


def test_every_graph_loads_and_runs_on_cpu(plain):
    root, _ = plain
    m = Manifest.load(root / "out")
    graphs = GraphSet(m)
    rng = np.random.default_rng(0)
    for name in m.graphs:
        runner = graphs[name]
        session = runner.session
        rows = (3 if name in ("prefill", "mtp") or name.startswith("mtp_") else 1 if name.startswith(("decode", "sample"))
                else int(name[-1]) + 1)
        feeds = {}
        for i in session.get_inputs():
            if i.name == "input_ids":
                feeds[i.name] = rng.integers(0, m.spec.vocab_size, (2, rows))
            elif i.name == "positions":
                feeds[i.name] = np.tile(np.arange(5, 5 + rows), (2, 1))
            elif i.name == "hidden":
                feeds[i.name] = rng.standard_normal((2, rows, m.spec.hidden_size)).astype(np.float32)
            elif i.name == "logits":  # sample_logits: a prefill's last row
                feeds[i.name] = rng.standard_normal((2, 1, m.spec.vocab_size)).astype(np.float32)
            elif i.name == "last":
                feeds[i.name] = np.array([rows - 1, 0])
            elif i.name in SAMPLING_FEEDS:  # the sampling graphs: row 0 samples, row 1 is greedy
                feeds[i.name] = SAMPLING_FEEDS[i.name](i.shape)
            else:  # a state: the runtime's buffer (the graph's KV inputs take any window W of it)
                feeds[i.name] = np.zeros([2] + list(m.states[i.name]["shape"][1:]), np.float32)
        out = runner.run(feeds)
        if name.startswith(("mtp_propose", "mtp_sample")):  # drafts d1..dk, and the catch-up's KV rows
            assert out["drafts"].shape == (2, int(name[-1])) and np.isfinite(out["new_key.mtp"]).all()
            if name.startswith("mtp_sample"):  # draws from the distributions it returns
                probs = out["draft_probs"]
                assert probs.shape == (2, int(name[-1]), m.spec.vocab_size)
                np.testing.assert_allclose(probs.sum(-1), 1, atol=1e-5)
                assert (np.take_along_axis(probs[0], out["drafts"][0][:, None], 1) > 0).all()
                assert ((probs[0] > 0).sum(-1) <= 5).all()  # top_k = 5 (the CPU graphs truncate q)
            continue
        if name == "sample_logits":  # tokens alone: row 0 drawn, row 1 (greedy) the argmax
            assert out["tokens"].shape == (2, 1) and out["tokens"][1, 0] == feeds["logits"][1, 0].argmax()
            continue
        scored = 1 if name == "prefill" else rows  # a prefill scores its prompt's last row alone
        assert out["tokens"].shape == (2, scored) and out["logits"].shape == (2, scored, m.spec.vocab_size)
        assert np.isfinite(out["logits"]).all()
        assert "CPUExecutionProvider" in session.get_providers()


def test_graphs_use_fused_ops(plain):
    import onnx

    root, _ = plain
    ops = lambda name: {n.op_type for n in onnx.load(str(root / "out" / name), load_external_data=False).graph.node}  # noqa
    decode = ops("decode.onnx")
    assert {"LinearAttention", "CausalConvWithState", "LinearAttentionGate", "GatedRMSNorm",
            "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization"} <= decode
    assert "LinearAttention" in ops("verify_select_k2.onnx")


def test_cli_convert_and_generate(plain, tmp_path, capsys):
    from ortspec.cli import main

    root, expected = plain
    assert main(["convert", str(root / "ck"), str(tmp_path / "out"), "-K", "1", "--max-length", "64"]) == 0
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "out"), "--ids", "--prompt", "3 1 4 1 5 9 2 6", "--max-new-tokens",
                 "16", "-k", "1"]) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in expected[0]]
    assert main(["generate", str(tmp_path / "out"), "--prompt", "def main():", "--max-new-tokens", "4"]) == 0


# -- errors ----------------------------------------------------------------------------------

def test_missing_directory_and_config(tmp_path):
    with pytest.raises(ortspec.CheckpointNotFoundError, match="does not exist"):
        convert(tmp_path / "nope", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ortspec.CheckpointNotFoundError, match="no config.json"):
        convert(tmp_path / "empty", tmp_path / "out")


def _edit_config(ck, **changes):
    config = json.loads((ck / "config.json").read_text())
    config.update(changes)
    (ck / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes,match", [
    (dict(model_type="qwen3_next"), "mixture-of-experts"),
    (dict(model_type="llama"), "'llama' is not supported"),
    (dict(num_experts=8), "mixture-of-experts"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
     "sliding_attention"),
])
def test_unsupported_models(plain, tmp_path, changes, match):
    root, _ = plain
    shutil.copytree(root / "ck", tmp_path / "ck")
    _edit_config(tmp_path / "ck", **changes)
    with pytest.raises(ortspec.UnsupportedModelError, match=match):
        convert(tmp_path / "ck", tmp_path / "out")


@pytest.mark.parametrize("edit,match", [
    ("drop", "'model.layers.1.linear_attn.A_log' is missing"),
    ("reshape", r"'model.layers.3.self_attn.k_proj.weight' has shape \[16, 64\] but config.json implies \[32, 64\]"),
    ("drop_mtp_layer", "'mtp.layers.0.self_attn.q_proj.weight' is missing"),
])
def test_bad_weights(plain, tmp_path, edit, match):
    root, _ = plain
    shutil.copytree(root / "ck", tmp_path / "ck")
    tensors = load_file(tmp_path / "ck" / "model.safetensors")
    if edit == "drop":
        del tensors["model.layers.1.linear_attn.A_log"]
    elif edit == "reshape":
        tensors["model.layers.3.self_attn.k_proj.weight"] = tensors["model.layers.3.self_attn.k_proj.weight"][:16]
    else:
        del tensors["mtp.layers.0.self_attn.q_proj.weight"]
    save_file(tensors, tmp_path / "ck" / "model.safetensors")
    with pytest.raises(ortspec.WeightError, match=match):
        convert(tmp_path / "ck", tmp_path / "out")


def test_no_safetensors_and_bad_options(plain, tmp_path):
    root, _ = plain
    (tmp_path / "ck").mkdir()
    shutil.copy(root / "ck" / "config.json", tmp_path / "ck")
    with pytest.raises(ortspec.CheckpointNotFoundError, match="no \\*.safetensors"):
        convert(tmp_path / "ck", tmp_path / "out")
    with pytest.raises(ortspec.CheckpointError, match="dtype 'int8'"):
        convert(root / "ck", tmp_path / "out", dtype="int8")
    with pytest.raises(ortspec.CheckpointError, match="quant='int8'"):
        convert(root / "ck", tmp_path / "out", quant="int8")
    with pytest.raises(ortspec.CheckpointError, match="num_speculative_tokens=9"):
        convert(root / "ck", tmp_path / "out", num_speculative_tokens=9)


def test_ort_is_cpu_build_by_default():
    assert "CPUExecutionProvider" in ort.get_available_providers()
