"""Layer-level checks against torch references, fp32 tolerance: the GDN layer and the attention
layer against transformers' own modules, the MTP head against a reference of the published
semantics (tests/reference_mtp.py), also for a continuation that goes through the states."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto

import ortspec
from ortspec.converter.builder import CPU, GraphBuilder, WeightStore
from ortspec.converter.checkpoint import CheckpointReader
from ortspec.converter.gdn_cpu import make_gated_deltanet_rows
from ortspec.converter.layers import make_attention, make_gated_deltanet, make_step_inputs
from ortspec.converter.weights import WeightPreparer, rope_tables
from ortspec.model_spec import FULL, LINEAR, ModelSpec
from ortspec.runtime.graphs import GraphSet
from tests.reference_mtp import mtp_reference, reference_drafts, target_model

F32, I64 = TensorProto.FLOAT, TensorProto.INT64
ATOL = 2e-5
MAX_LENGTH = 64


def layer_session(checkpoint, tmp_path, layer: int):
    """A one-layer ONNX graph (mixer only) built with the converter's own make_* functions."""
    spec = ModelSpec.from_checkpoint(checkpoint)
    store = WeightStore()
    WeightPreparer(spec, CheckpointReader(checkpoint), store).decoder_layer(f"layers.{layer}", "L", spec.layer_types[layer])
    cos, sin = rope_tables(spec, MAX_LENGTH)
    store.add("rope.cos", cos)
    store.add("rope.sin", sin)
    g = GraphBuilder("layer", store)
    x = g.input("x", F32, ["B", "M", spec.hidden_size])
    positions = g.input("positions", I64, ["B", "M"])
    if spec.layer_types[layer] == FULL:
        key = g.input("key", F32, ["B", spec.num_key_value_heads, spec.head_dim, MAX_LENGTH])
        value = g.input("value", F32, ["B", spec.num_key_value_heads, MAX_LENGTH, spec.head_dim])
        out, new_key, new_value = make_attention(g, spec, x, "L", make_step_inputs(g, spec, positions, MAX_LENGTH), key, value)
        outputs = {"out": out, "new_key": new_key, "new_value": new_value}
    else:
        conv = g.input("conv", F32, ["B", spec.linear_conv_kernel_dim - 1, spec.conv_dim])
        rec = g.input("rec", F32, ["B", spec.linear_num_value_heads, spec.linear_key_head_dim, spec.linear_value_head_dim])
        make_step_inputs(g, spec, positions, MAX_LENGTH)  # unused by GDN; keeps positions an input in use
        out, conv_out, rec_out = make_gated_deltanet(g, spec, x, "L", conv, rec)
        outputs = {"out": out, "conv_out": conv_out, "rec_out": rec_out}
    for name, value_name in outputs.items():
        g.output(value_name, name, F32, None)
    layout = store.save(tmp_path)
    import onnx

    onnx.save(g.build(layout), str(tmp_path / "layer.onnx"))
    return spec, ort.InferenceSession(str(tmp_path / "layer.onnx"), providers=["CPUExecutionProvider"])


def cpu_gdn_session(checkpoint, tmp_path, layer: int, rows: int, windows: bool):
    """GDN layer ``layer`` as the CPU graphs build it (converter/gdn_cpu.py), at a static row count."""
    spec = ModelSpec.from_checkpoint(checkpoint)
    store = WeightStore()
    WeightPreparer(spec, CheckpointReader(checkpoint), store).decoder_layer(f"layers.{layer}", "L", LINEAR)
    g = GraphBuilder("gdn_rows", store, CPU)
    x = g.input("x", F32, ["B", rows, spec.hidden_size])
    conv = g.input("conv", F32, ["B", spec.linear_conv_kernel_dim - 1, spec.conv_dim])
    rec = g.input("rec", F32, ["B", spec.linear_num_value_heads, spec.linear_key_head_dim, spec.linear_value_head_dim])
    for value, name in zip(make_gated_deltanet_rows(g, spec, x, "L", conv, rec, rows, windows),
                           ("out", "conv_out", "rec_out")):
        if isinstance(value, list):  # windows: the state after each row, one output per row
            for j, row in enumerate(value):
                g.output(row, f"{name}.{j}", F32, None)
        else:
            g.output(value, name, F32, None)
    import onnx

    path = tmp_path / f"gdn_{rows}_{windows}.onnx"
    onnx.save(g.build(store.save(tmp_path)), str(path))
    return spec, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("config,layer", [("base", 0), ("mixed", 2)])  # 2 value heads per key head; 1 (dk != dv)
def test_cpu_gdn_layer_matches_transformers_and_its_verify_its_decodes(models, tmp_path, config, layer):
    """The CPU graphs' GDN layer: one-row decodes from zero states match transformers' module
    over the sequence, and a verify over the last 4 rows gives each row's output and the states
    after it bit for bit as those decodes did."""
    checkpoint = models.checkpoint(config)
    spec, decode = cpu_gdn_session(checkpoint, tmp_path, layer, 1, False)
    _, verify = cpu_gdn_session(checkpoint, tmp_path, layer, 4, True)
    T = 12
    x = np.random.default_rng(layer).standard_normal((2, T, spec.hidden_size)).astype(np.float32)  # 2 requests
    want = np.concatenate([hf_layer_output(target_model(checkpoint), layer, x[b: b + 1], LINEAR) for b in range(2)])
    states, outs, after = zero_states(spec, decode, 2), [], []
    for t in range(T):
        out = run_layer(decode, x[:, t: t + 1], None, states)
        if t == T - 4:
            before = dict(states)
        states = {"conv": out["conv_out"], "rec": out["rec_out"]}
        outs.append(out["out"])
        after.append(states)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), want, atol=ATOL, rtol=1e-4)
    windows = run_layer(verify, x[:, T - 4:], None, before)
    assert np.array_equal(windows["out"], np.concatenate(outs[T - 4:], axis=1))
    for j in range(4):
        assert np.array_equal(windows[f"conv_out.{j}"], after[T - 4 + j]["conv"])
        assert np.array_equal(windows[f"rec_out.{j}"], after[T - 4 + j]["rec"])


def zero_states(spec, session, batch):
    return {i.name: np.zeros([batch] + list(i.shape[1:]), np.float32) for i in session.get_inputs()
            if i.name not in ("x", "positions")}


def hf_layer_output(model, layer, x, kind):
    """transformers' own mixer module over the whole sequence x [1, T, H] (no cache)."""
    module = model.model.layers[layer]
    with torch.no_grad():
        if kind == LINEAR:
            return module.linear_attn(torch.from_numpy(x)).numpy()
        positions = torch.arange(x.shape[1])[None]
        cos_sin = model.model.rotary_emb(torch.from_numpy(x), positions)
        T = x.shape[1]
        mask = torch.zeros(T, T).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))[None, None]
        return module.self_attn(torch.from_numpy(x), position_embeddings=cos_sin, attention_mask=mask)[0].numpy()


def run_layer(session, x, positions, states):
    names = [o.name for o in session.get_outputs()]
    feeds = {"x": x, **states} if positions is None else {"x": x, "positions": positions, **states}
    return dict(zip(names, session.run(None, feeds)))


@pytest.mark.parametrize("config,layer", [("base", 0), ("base", 3), ("attn_first", 0), ("mixed", 1), ("mixed", 2)])
def test_layer_matches_transformers(models, tmp_path, config, layer):
    checkpoint = models.checkpoint(config)
    spec, session = layer_session(checkpoint, tmp_path, layer)
    kind = spec.layer_types[layer]
    model = target_model(checkpoint)
    T = 12
    x = np.random.default_rng(layer).standard_normal((1, T, spec.hidden_size)).astype(np.float32)
    want = hf_layer_output(model, layer, x, kind)  # [1, T, H]

    # whole sequence in one call
    got = run_layer(session, x, np.arange(T)[None], zero_states(spec, session, 1))
    np.testing.assert_allclose(got["out"], want, atol=ATOL, rtol=1e-4)

    # first T-3 rows, then the rest one row at a time through the states (decode path)
    states, outs, positions = zero_states(spec, session, 1), [], np.arange(T - 3)
    for rows in [slice(0, T - 3)] + [slice(t, t + 1) for t in range(T - 3, T)]:
        positions = np.arange(rows.start, rows.stop)
        out = run_layer(session, x[:, rows], positions[None], states)
        states = next_states(states, out, kind, positions)
        outs.append(out["out"])
    np.testing.assert_allclose(np.concatenate(outs, axis=1), want, atol=ATOL, rtol=1e-4)


def next_states(states, out, kind, positions):
    """Feeds a call's state outputs into the next call (KV rows written at their positions)."""
    if kind == LINEAR:
        return {"conv": out["conv_out"], "rec": out["rec_out"]}
    key, value = states["key"].copy(), states["value"].copy()
    key[:, :, :, positions] = out["new_key"]
    value[:, :, positions, :] = out["new_value"]
    return {"key": key, "value": value}


def test_mtp_head_matches_reference(models):
    """The MTP graph over T positions against the torch reference of the published head."""
    checkpoint = models.checkpoint("base")
    graphs = GraphSet(ortspec.Session(models.converted("base")).manifest)
    H = graphs.manifest.spec.hidden_size
    rng = np.random.default_rng(5)
    T = 10
    ids = rng.integers(0, graphs.manifest.spec.vocab_size, (1, T))
    hidden = rng.standard_normal((1, T, H)).astype(np.float32)
    ref_logits, ref_hidden = mtp_reference(checkpoint).forward(ids[0], hidden[0], np.arange(T))
    cache = {n: np.zeros([1] + e["shape"][1:], np.float32) for n, e in graphs.manifest.states.items()
             if e["layer"] == "mtp"}

    def run(rows):  # the one-pass "mtp" graph, its KV rows written back at their positions
        out = graphs["mtp"].run({"input_ids": ids[:, rows], "hidden": hidden[:, rows],
                                 "positions": np.arange(rows.start, rows.stop)[None], **cache})
        cache["key.mtp"][..., rows] = out["new_key.mtp"]
        cache["value.mtp"][:, :, rows] = out["new_value.mtp"]
        return out

    out, rest = run(slice(0, 6)), run(slice(6, T))  # the second continues through the KV cache
    logits = np.concatenate([out["logits"], rest["logits"]], axis=1)[0]
    hidden_out = np.concatenate([out["hidden_out"], rest["hidden_out"]], axis=1)[0]
    np.testing.assert_allclose(hidden_out, ref_hidden.numpy(), atol=ATOL, rtol=1e-4)
    np.testing.assert_allclose(logits, ref_logits.numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("config", ["base", "mixed"])
def test_drafts_match_reference(models, config):
    """ortspec's k recursive drafts after a prompt equal the reference's (target hiddens, own hidden)."""
    from ortspec.speculative.decoder import Decoder
    from ortspec.speculative.drafts import MTPDrafts
    from ortspec.speculative.requests import Batch, Request
    from ortspec.speculative.stats import Stats

    graphs = GraphSet(ortspec.Session(models.converted(config)).manifest)
    prompt = [7, 3, 99, 14, 2, 60, 5, 8]
    decoder = Decoder(graphs, 1, 4, "select", Stats())
    req = Request(row=0, prompt=prompt, max_new_tokens=30)
    decoder.admit([req])
    for _ in range(3):  # a few steps so the catch-up path (not only prefill) fed the head
        decoder.step()
    drafts = MTPDrafts(decoder.mtp).propose(Batch([req]), 4)[0]
    want, logits = reference_drafts(models.checkpoint(config), req.tokens, 4, return_logits=True)
    for i, (got, ref) in enumerate(zip(drafts.tolist(), want.tolist())):
        if got != ref:
            top2 = torch.topk(logits[i], 2).values
            assert float(top2[0] - top2[1]) < 1e-4, f"draft {i}: {got} vs reference {ref}"
            break
