"""The CPU variants of the graphs ({graph}.cpu.onnx, converter/gdn_cpu.py): written for float32
models beside the portable ones, loaded by CPU sessions, and exact only as a set: a verify of
the other formulation than the decode breaks the bitwise state check."""

from __future__ import annotations

import onnx
import pytest

from ortspec.manifest import Manifest, runs_on_gpus_only
from ortspec.runtime.graphs import GraphSet
from ortspec.speculative.exactness import ExactnessError, check_speculative, plain_decode_states
from tests.small_models import convert_small

PROMPTS = [[5, 17, 99, 3, 250, 7, 11], [42], [8, 8, 8, 300, 1, 2, 3, 4, 5, 6, 7]]
FUSED_GDN = {"LinearAttention", "CausalConvWithState", "GatedRMSNorm"}


def op_types(manifest: Manifest, name: str, provider: str | None) -> set[str]:
    path = manifest.graph_path(name, provider)
    return {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}


def test_float32_models_carry_a_cpu_variant_of_every_graph(models):
    """Every graph (a conversion writes no GPU-only graph now: manifest.runs_on_gpus_only names
    the tempered graphs of models converted before ortspec's sampling ops)."""
    manifest = Manifest.load(models.converted("base"))
    gpu_only = {name for name in manifest.graphs if runs_on_gpus_only(name)}
    assert gpu_only == set()
    for name, entry in manifest.graphs.items():
        assert ("cpu" not in entry) if name in gpu_only else (entry["cpu"]["file"] == f"{name}.cpu.onnx")
        assert entry["file"] == f"{name}.onnx"
        assert manifest.graph_entry(name, "cuda") is entry  # CUDA runs the portable graph
    for name in ("decode", "verify_k2", "verify_select_k2"):
        assert not op_types(manifest, name, "cpu") & (FUSED_GDN | {"ScaledSiLU"})
        assert FUSED_GDN | {"ScaledSiLU"} <= op_types(manifest, name, None)
    assert {"LinearAttention", "CausalConvWithState", "QuickGelu"} <= op_types(manifest, "prefill", "cpu")
    assert "GatedRMSNorm" not in op_types(manifest, "prefill", "cpu")
    assert "QuickGelu" in op_types(manifest, "mtp_propose_k2", "cpu")


def test_float16_models_have_portable_graphs_only(tmp_path, models):
    """Except, where their CUDA verifies take another GDN form than per_row (the default for
    float16: transition), per-row portable twins of those verifies for the CPU."""
    out = convert_small(models.checkpoint("base"), tmp_path / "f16", dtype="float16", gdn_verify="per_row")
    manifest = Manifest.load(out)
    assert not any("cpu" in entry for entry in manifest.graphs.values())
    assert manifest.graph_path("decode", "cpu") == out / "decode.onnx"
    default = Manifest.load(convert_small(models.checkpoint("base"), tmp_path / "default", dtype="float16"))
    assert default.gdn_verify == "transition"
    assert {name for name, entry in default.graphs.items() if "cpu" in entry} == {
        name for name in default.graphs if name.startswith(("verify_select_k", "verify_mtp_k", "verify_mtp_sample_k"))}
    assert not any(runs_on_gpus_only(name) for name in default.graphs)


def test_a_model_without_cpu_variants_still_runs_exact_on_the_cpu(models):
    """Models converted before the variants (portable graphs only) keep working: the CPU then
    runs the portable set, which is exact on its own."""
    manifest = Manifest.load(models.converted("base"))
    for entry in manifest.graphs.values():
        entry.pop("cpu", None)
    check_speculative(GraphSet(manifest), PROMPTS, 16, 3, "select", p=0.6)


def test_planted_bug_a_verify_of_the_other_formulation_is_caught(models):
    """Each formulation is exact with itself only: a CPU decode with a portable verify
    (LinearAttention per row) leaves GDN states that differ in their last bits."""
    manifest = Manifest.load(models.converted("base"))
    check_speculative(GraphSet(manifest), PROMPTS, 16, 3, "select", p=0.6)
    for name in ("verify_select_k3", "verify_mtp_k3"):  # the two-Run and the one-Run step's verify
        verify = manifest.graphs[name]
        verify["cpu"] = {"file": verify["file"], "weights": verify["weights"]}
    for fused in (True, False):
        with pytest.raises(ExactnessError, match="target state recurrent"):
            check_speculative(GraphSet(manifest), PROMPTS, 16, 3, "select", p=0.6, fused_verify=fused)


def test_cpu_and_portable_graphs_agree_on_tokens(models):
    """Two formulations of one model: the same greedy tokens on these prompts (they differ in
    the last bits of a state, not in what the model says)."""
    manifest = Manifest.load(models.converted("base"))
    cpu, _ = plain_decode_states(GraphSet(manifest), PROMPTS, 12, 1)
    for entry in manifest.graphs.values():
        entry.pop("cpu", None)
    portable, _ = plain_decode_states(GraphSet(manifest), PROMPTS, 12, 1)
    assert portable == cpu


def output_producers(manifest: Manifest, name: str, provider: str | None) -> dict[str, str]:
    """Graph output name -> the op type of the node that writes it."""
    graph = onnx.load(str(manifest.graph_path(name, provider)), load_external_data=False).graph
    producers = {out: node.op_type for node in graph.node for out in node.output}
    return {o.name: producers.get(o.name) for o in graph.output}


def test_cpu_verify_graphs_emit_each_rows_state_as_its_own_output(models):
    """The CPU variants' windows: the state after row j of GDN layer i is the output
    {kind}_window.{i}.{j}, written by the op that computes it (no stacking Concat: one copy of
    every state less per step); the portable graphs keep the stacked [M, B, ...] window CUDA reads."""
    manifest = Manifest.load(models.converted("base"))
    layer = manifest.spec.layer_types.index("linear_attention")
    for name in ("verify_select_k2", "verify_mtp_k2"):
        cpu, portable = output_producers(manifest, name, "cpu"), output_producers(manifest, name, None)
        for kind in ("conv", "recurrent"):
            window = f"{kind}_window.{layer}"
            assert window in portable and window not in cpu
            assert {n for n in cpu if n.startswith(window + ".")} == {f"{window}.{j}" for j in range(3)}
        assert cpu[f"recurrent_window.{layer}.2"] == "Add" and cpu[f"conv_window.{layer}.0"] == "Slice"
