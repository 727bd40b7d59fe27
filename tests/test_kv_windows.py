"""KV window variants (converter/kv_windows.py): what a conversion writes and records, and that a
variant computes what the portable graph computes over the same full caches. The variants run on
CUDA; here ONNX Runtime's CPU EP runs their files directly, where the attention's bits do not
depend on the slots past the positions (masked slots add exact zeros, and the CPU's products
give the same bits over any window past the positions: tools/row_invariance.py), so the
comparison is bitwise. Which variant the runtime picks: tests/test_kv_window_runs.py."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import ortspec
from ortspec import converter
from ortspec.converter.kv_windows import has_window_variants, window_buckets
from ortspec.manifest import Manifest, split_window_name, window_graph_name
from ortspec.runtime import custom_ops

from tests.conftest import WINDOWED_K as K
from tests.conftest import WINDOWED_MAX_LENGTH as MAX_LENGTH

WINDOWED = ("decode", "decode_sample", "verify_k3", "verify_select_k3", "verify_mtp_k3", "verify_mtp_sample_k3",
            "mtp_propose_k3", "mtp_sample_k3")


def test_buckets_double_from_256_below_max_length():
    assert window_buckets(256) == [] and window_buckets(64) == []
    assert window_buckets(257) == [256] and window_buckets(1024) == [256, 512]
    assert window_buckets(4096) == [256, 512, 1024, 2048]
    assert [n for n in ("prefill", "mtp", "decode.stage0", "verify_k2.stage1", *WINDOWED) if has_window_variants(n)] \
        == list(WINDOWED)
    assert split_window_name(window_graph_name("verify_mtp_k3", 512)) == ("verify_mtp_k3", 512)
    assert split_window_name("decode.stage1") == ("decode.stage1", None)


def test_the_conversion_records_one_variant_per_captured_graph(windowed_model, models):
    manifest = Manifest.load(windowed_model)
    with_windows = {name for name, entry in manifest.graphs.items() if "windows" in entry}
    assert with_windows == {name for name in manifest.graphs if has_window_variants(name)}
    assert {"decode", "decode_sample", "verify_mtp_k1", "verify_mtp_sample_k3", "mtp_sample_k3"} <= with_windows
    assert "prefill" not in with_windows
    for name in with_windows:
        entry = manifest.graph_entry(window_graph_name(name, 256), "cuda")
        assert entry == manifest.graphs[name]["windows"]["256"] and entry["file"] == f"{name}.w256.onnx"
        assert entry["weights"] == manifest.graphs[name]["weights"] and entry["file"] in manifest.files
        assert manifest.window_buckets(name) == [256]
    graph = onnx.load(str(windowed_model / "verify_mtp_k3.w256.onnx"), load_external_data=False).graph
    dims = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in graph.input}
    assert dims["key.3"][3] == dims["value.3"][2] == dims["key.mtp"][3] == MAX_LENGTH  # the whole buffers come in
    readers = {name: [n.op_type for n in graph.node if name in n.input] for name in ("key.3", "key.mtp", "positions")}
    assert readers == {"key.3": ["Slice"], "key.mtp": ["Slice"], "positions": ["Min"]}  # nothing reads them whole
    with pytest.raises(ortspec.ModelDirError, match=r"graph 'decode\.w512' is not in"):
        manifest.graph_entry("decode.w512")
    small = Manifest.load(models.converted("base"))  # max_length 256: no variant (CI conversions stay as fast)
    assert not any("windows" in entry for entry in small.graphs.values()) and small.window_buckets("decode") == []


def test_variants_leave_every_other_file_bit_for_bit(models, windowed_model, tmp_path, monkeypatch):
    """The CPU graphs and the portable ones are the files a conversion without variants writes."""
    monkeypatch.setattr(converter, "window_buckets", lambda max_length: [])
    plain = ortspec.convert(models.checkpoint("base"), tmp_path / "plain", num_speculative_tokens=K,
                            max_length=MAX_LENGTH, progress=False)
    mine, theirs = Manifest.load(windowed_model).files, Manifest.load(plain).files
    assert set(theirs) < set(mine) and all(mine[name] == record for name, record in theirs.items())
    assert {name for name in set(mine) - set(theirs)} == {f"{name}.w256.onnx" for name in Manifest.load(windowed_model).graphs
                                                           if has_window_variants(name)}


def random_feeds(session: ort.InferenceSession, first: list[int], seed: int = 0) -> dict:
    """Inputs of a graph over B = len(first) rows: positions first[j] + 0..M-1, random caches and
    states of max_length slots (stale slots finite, as the runtime's are), greedy sampling inputs."""
    rng, batch, rows = np.random.default_rng(seed), len(first), K + 1  # M: a verify's, or a catch-up's after one
    feeds = {}
    for value in session.get_inputs():
        shape = [batch] + [d if isinstance(d, int) else rows if d == "M" else MAX_LENGTH for d in value.shape[1:]]
        if value.name == "positions":
            feeds[value.name] = np.array(first, np.int64)[:, None] + np.arange(shape[1])
        elif value.name == "input_ids":
            feeds[value.name] = rng.integers(0, 300, shape)
        elif value.name == "last":
            feeds[value.name] = np.arange(batch) % rows  # row a of the catch-up: where the drafts start
        elif value.name in ("temperature", "top_k", "min_p"):
            feeds[value.name] = np.zeros(shape, np.int64 if value.name == "top_k" else np.float32)
        elif value.name == "top_p":
            feeds[value.name] = np.ones(shape, np.float32)
        elif value.name in ("uniforms", "draft_probs"):  # in [0, 1): uniforms, and the drafts' distributions
            feeds[value.name] = rng.random(shape, dtype=np.float32)
        else:  # caches, GDN states, hiddens
            feeds[value.name] = rng.standard_normal(shape).astype(np.float32) * 0.5
    return feeds


def run_both(windowed_model, name: str, first: list[int]) -> tuple[dict, dict]:
    """(portable outputs, W = 256 variant outputs) on the same feeds, on the CPU EP."""
    sessions = [ort.InferenceSession(str(windowed_model / f), custom_ops.session_options(), providers=["CPUExecutionProvider"])
                for f in (f"{name}.onnx", f"{name}.w256.onnx")]
    feeds = random_feeds(sessions[0], first)
    return [dict(zip([o.name for o in s.get_outputs()], s.run(None, feeds))) for s in sessions]


@pytest.mark.parametrize("name", WINDOWED)
def test_a_variant_computes_the_portable_graphs_bits(windowed_model, name):
    """Rows up to the window's edge (the head's drafts reach k-1 slots past a verify's last row):
    every output bitwise the portable graph's over all max_length slots."""
    portable, variant = run_both(windowed_model, name, [0, 100, 256 - 2 * K])
    assert portable.keys() == variant.keys()
    for output, value in portable.items():
        np.testing.assert_array_equal(variant[output], value, err_msg=output)


@pytest.mark.parametrize("name", ["decode", "verify_mtp_k3", "mtp_propose_k3"])
def test_a_row_past_the_window_runs_and_leaves_the_others_alone(windowed_model, name):
    """A finished request's row keeps running on CUDA past the window its run was given: the
    variant clamps its positions inside (an index past W would be out of bounds), and the rows
    inside get the portable graph's bits; the row past it gets other values (not read)."""
    portable, variant = run_both(windowed_model, name, [10, 300, 200])
    for output, value in portable.items():
        if value.ndim and value.shape[0] == 3 and value.dtype == np.float32:
            np.testing.assert_array_equal(variant[output][[0, 2]], value[[0, 2]], err_msg=output)
    assert not np.array_equal(variant["new_key.mtp" if name.startswith("mtp") else "new_key.3"][1],
                              portable["new_key.mtp" if name.startswith("mtp") else "new_key.3"][1])


def test_models_converted_before_variants_have_none(windowed_model, tmp_path):
    copy = shutil.copytree(windowed_model, tmp_path / "old")
    doc = json.loads((copy / "manifest.json").read_text())
    for entry in doc["graphs"].values():
        entry.pop("windows", None)
    (copy / "manifest.json").write_text(json.dumps(doc))
    manifest = Manifest.load(copy)
    assert manifest.window_buckets("decode") == [] and manifest.graph_entry("decode") == doc["graphs"]["decode"]
    with pytest.raises(ortspec.ModelDirError, match=r"graph 'decode\.w256' is not in"):
        manifest.graph_entry("decode.w256")
    doc["graphs"]["decode"]["windows"] = {"wide": {"file": "decode.onnx", "weights": []}}
    (copy / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ortspec.ModelDirError, match=r"invalid KV windows for graph 'decode'.*reconvert"):
        Manifest.load(copy)
