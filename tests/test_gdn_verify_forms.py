"""The forms of the portable select verifies' GDN layers (convert gdn_verify, manifest.GDN_VERIFY_FORMS):
which ops each graph runs and what it emits, that the CPU variants and every other graph do not
depend on the form, and what a CPU Session of a CUDA-only form is told."""

from __future__ import annotations

import collections
import json

import onnx
import pytest

import ortspec
from ortspec.manifest import TRANSITION_RECORD, Manifest, has_state_windows
from tests.small_models import convert_small

SELECT_VERIFIES = ("verify_select_k2", "verify_mtp_k2")


@pytest.fixture(scope="module")
def forms(models, tmp_path_factory):
    """The "base" checkpoint (3 GDN layers of 4) converted in each form, K=2."""
    root = tmp_path_factory.mktemp("forms")
    return {form: Manifest.load(convert_small(models.checkpoint("base"), root / form, num_speculative_tokens=2,
                                              gdn_verify=form))
            for form in ("per_row", "state_window", "transition")}


def graph(manifest: Manifest, name: str, provider: str | None = None) -> onnx.GraphProto:
    return onnx.load(str(manifest.graph_path(name, provider)), load_external_data=False).graph


def gdn_layers(manifest: Manifest) -> list[int]:
    return [i for i, kind in enumerate(manifest.spec.layer_types) if kind == "linear_attention"]


def test_each_form_runs_the_recurrence_as_it_says(forms):
    """per_row: LinearAttention once per row and layer; state_window and transition: once per layer,
    with state_window = M (and its windows) or none (and the record)."""
    layers = gdn_layers(forms["per_row"])
    for name in SELECT_VERIFIES:
        for form, manifest in forms.items():
            nodes = [n for n in graph(manifest, name).node if n.op_type in ("LinearAttention", "CausalConvWithState")]
            windows = {n.op_type: [a.i for a in n.attribute if a.name == "state_window"] for n in nodes}
            counts = collections.Counter(n.op_type for n in nodes)
            assert counts["CausalConvWithState"] == len(layers)
            assert counts["LinearAttention"] == len(layers) * (3 if form == "per_row" else 1)
            assert windows == ({"LinearAttention": [3], "CausalConvWithState": [3]} if form == "state_window"
                               else {"LinearAttention": [], "CausalConvWithState": []})


def test_the_transition_form_emits_the_record_and_no_state(forms):
    manifest = forms["transition"]
    for name in SELECT_VERIFIES:
        outputs = {o.name for o in graph(manifest, name).output}
        for i in gdn_layers(manifest):
            assert {f"{part}.{i}" for parts in TRANSITION_RECORD.values() for part in parts} <= outputs
            assert not {f"conv_window.{i}", f"recurrent_window.{i}"} & outputs
    for form in ("per_row", "state_window"):
        outputs = {o.name for o in graph(forms[form], "verify_select_k2").output}
        assert {f"recurrent_window.{i}" for i in gdn_layers(forms[form])} <= outputs


def test_only_the_portable_select_verifies_depend_on_the_form(forms):
    """Every CPU variant and every other portable graph is the same file whatever the form (the CPU
    keeps its bitwise per-row formulation); the manifest records the form."""
    base = forms["per_row"]
    for form, manifest in forms.items():
        assert manifest.gdn_verify == form
        assert json.loads((manifest.dir / "manifest.json").read_text())["gdn_verify"] == form
        for name, entry in base.graphs.items():
            if "cpu" in entry:
                assert (base.dir / entry["cpu"]["file"]).read_bytes() == (manifest.dir / entry["cpu"]["file"]).read_bytes()
            if not has_state_windows(name):
                assert (base.dir / entry["file"]).read_bytes() == (manifest.dir / entry["file"]).read_bytes(), name


def test_a_float16_model_of_another_form_runs_per_row_on_the_cpu(models, tmp_path):
    """float16 models have no CPU graphs of their own: a form other than per_row gets per-row CPU
    variants of its windowed verifies (what a CPU Session ran before the forms existed), so it loads
    and its speculation equals greedy on the CPU; a manifest without them is told what to do."""
    out = convert_small(models.checkpoint("base"), tmp_path / "f16", dtype="float16", gdn_verify="state_window")
    manifest = Manifest.load(out)
    assert manifest.graph_entry("verify_select_k1", "cpu")["file"] != manifest.graph_entry("verify_select_k1",
                                                                                           "cuda")["file"]
    assert manifest.graph_entry("decode", "cpu")["file"] == "decode.onnx"  # no window: the portable graph
    greedy = ortspec.Session(out).generate([[5, 17, 99, 3]], max_new_tokens=12)
    assert ortspec.Session(out, num_speculative_tokens=1).generate([[5, 17, 99, 3]], max_new_tokens=12) == greedy
    del manifest.graphs["verify_select_k1"]["cpu"]  # as a conversion without those variants would leave it
    with pytest.raises(ortspec.ProviderError, match="provider='cuda', or reconvert with gdn_verify='per_row'"):
        manifest.graph_entry("verify_select_k1", "cpu")


def test_an_unknown_form_in_a_manifest_is_refused(forms, tmp_path):
    import shutil

    copy = shutil.copytree(forms["per_row"].dir, tmp_path / "m")
    doc = json.loads((copy / "manifest.json").read_text())
    doc["gdn_verify"] = "windows"
    (copy / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ortspec.ModelDirError, match="gdn_verify 'windows', not one of per_row, state_window"):
        Manifest.load(copy)
    del doc["gdn_verify"]  # written before the field: per row
    (copy / "manifest.json").write_text(json.dumps(doc))
    assert Manifest.load(copy).gdn_verify == "per_row"


def test_state_window_verifies_read_past_windows_the_runtime_lays_out(forms):
    """The state_window verify of M rows takes each GDN state as its past window [M, B, ...] (the
    ops read slot M-1): no Pad writes it, no [B, ...] state input is left."""
    manifest = forms["state_window"]
    for name, rows in (("verify_select_k2", 3), ("verify_mtp_k2", 3), ("verify_select_k1", 2)):
        g = graph(manifest, name)
        inputs = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in g.input}
        for i in gdn_layers(manifest):
            assert inputs[f"recurrent.{i}.past{rows}"][:2] == [rows, "B"] and f"recurrent.{i}" not in inputs
            assert inputs[f"conv.{i}.past{rows}"][:2] == [rows, "B"] and f"conv.{i}" not in inputs
        assert not any(n.op_type == "Pad" for n in g.node)


def test_past_windows_end_at_the_live_rows_and_copy_nothing():
    """LayerState with past slots (HostArrays): the live buffer is the last slot of its allocation;
    the feed of a verify of M rows over rows 1..3 is an [M, 2, ...] view whose last slot is those
    rows, for every M; a subset of rows is refused (state_window verifies run on CUDA)."""
    import numpy as np

    from ortspec.runtime.arrays import HostArrays
    from ortspec.runtime.states import LayerState, Rows, StateError

    layer = LayerState(HostArrays(), "recurrent.2", [4, 2, 3, 5], past_slots=5)
    layer.buffer[...] = np.arange(layer.buffer.size, dtype=np.float32).reshape(layer.buffer.shape)
    feeds = layer.feeds(Rows([1, 2]))
    assert set(feeds) == {"recurrent.2"} | {f"recurrent.2.past{m}" for m in (2, 3, 4, 5)}
    for m in (2, 3, 4, 5):
        window = feeds[f"recurrent.2.past{m}"]
        assert window.shape == (m, 2, 2, 3, 5) and np.shares_memory(window, layer.buffer)
        np.testing.assert_array_equal(window[-1], layer.buffer[1:3])
    layer.buffer[2] += 1  # a commit into the live state shows in every window at once
    np.testing.assert_array_equal(feeds["recurrent.2.past4"][-1, 1], layer.buffer[2])
    with pytest.raises(StateError, match="contiguous rows only"):
        layer.feeds(Rows([0, 2]))


def test_the_cli_converts_in_a_form(models, tmp_path):
    from ortspec.cli import main

    out = tmp_path / "cli"
    assert main(["convert", str(models.checkpoint("base")), str(out), "-k", "1", "--max-length", "32",
                 "--gdn-verify", "transition"]) == 0
    assert Manifest.load(out).gdn_verify == "transition"
