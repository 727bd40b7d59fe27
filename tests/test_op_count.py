"""Kernel-launching ops per graph (tools/op_count.py): every node a GPU step launches is ~2 us on
the H200, so the count of the tiny model's fp16 decode is held under a bound; a change that
re-adds casts, repeats heads or unfuses a norm or the RoPE fails here first."""

from __future__ import annotations

from onnx import TensorProto, helper

from ortspec.converter import builder, graphs, layers
from tests.small_models import convert_small
from tools.op_count import graph_kernel_ops, head_pass_ops, kernel_ops

# tiny "base" checkpoint (3 GDN layers + 1 attention layer), fp16 decode: 173 kernel ops before
# the slim graphs (Cast 35, Mul 23, Split 13, Add 9, ReduceSumSquare/Sqrt/Reciprocal/Tile 6
# each, ...), 115 after; with float32 activations (the default activations, auto, cast 16 fewer)
FP16_DECODE_BOUND = 115
# the same model's MTP head, fp16, K = 3: mtp_propose_k3 132 kernel ops (44 a pass) and verify_mtp_k3 142 more than
# verify_select_k3 while every pass built its own mask, bias and scatter indices and the catch-up ran all its rows
# through the attention; 117 and 125 since the passes share them and only the catch-up's last row attends
FP16_PROPOSE_K3_BOUND = 117
FP16_FUSED_HEAD_K3_BOUND = 125
HEAD_GRAPHS = ["mtp_propose_k2", "mtp_propose_k3", "verify_select_k3", "verify_mtp_k3"]


def _decode_ops(checkpoint, out, activations="float32"):
    return graph_kernel_ops(convert_small(checkpoint, out, dtype="float16", activations=activations),
                            ["decode"])["decode"]


def test_fp16_decode_stays_under_its_kernel_bound(models, tmp_path):
    ops = _decode_ops(models.checkpoint("base"), tmp_path / "f16")
    assert sum(ops.values()) <= FP16_DECODE_BOUND, ops.most_common()
    assert ops["Cast"] == 2 * (3 * 4 + 1) + 1  # in and out: 2 projections + the MLP per layer, lm_head; embedding
    assert not {"Tile", "ReduceSumSquare", "Sqrt", "Reciprocal"} & set(ops)  # l2norm is one RMSNorm
    assert ops["Sigmoid"] == 1 and ops["RotaryEmbedding"] == 2  # the attention's output gate; q and k
    default = _decode_ops(models.checkpoint("base"), tmp_path / "auto", activations="auto")  # float16 between layers
    assert default["Cast"] == 2 * 4 + 1  # into and out of each mixer's float32 inside; the logits
    assert sum(default.values()) == sum(ops.values()) - (ops["Cast"] - default["Cast"])


def test_the_bound_catches_a_re_added_cast(models, tmp_path, monkeypatch):
    """Planted: every product casts back to float32 (the old MLP) -> over the bound."""
    linear = builder.GraphBuilder.linear

    def linear_cast_back(self, x, weight, hint=None, x_dtype=TensorProto.FLOAT, out_dtype=TensorProto.FLOAT):
        return linear(self, x, weight, hint, x_dtype=TensorProto.FLOAT)  # out_dtype ignored: float32 out

    monkeypatch.setattr(builder.GraphBuilder, "linear", linear_cast_back)
    assert sum(_decode_ops(models.checkpoint("base"), tmp_path / "f16").values()) > FP16_DECODE_BOUND


def test_views_launch_no_kernel():
    nodes = [helper.make_node("Reshape", ["x", "s"], ["r"]), helper.make_node("Unsqueeze", ["r", "a"], ["u"]),
             helper.make_node("Sigmoid", ["u"], ["y"]), helper.make_node("Cast", ["y"], ["z"], to=10)]
    graph = helper.make_graph(nodes, "g", [], [])
    assert kernel_ops(helper.make_model(graph)) == {"Sigmoid": 1, "Cast": 1}


def test_cpu_variants_are_counted_with_their_views(models, tmp_path):
    """--variant cpu: the {graph}.cpu.onnx a CPU Session runs, every node counted beside the kernels."""
    from tools.op_count import graph_nodes, main

    out = convert_small(models.checkpoint("base"), tmp_path / "f32")
    portable, cpu = graph_kernel_ops(out, ["decode"]), graph_kernel_ops(out, ["decode"], variant="cpu")
    assert "LinearAttention" in portable["decode"] and "LinearAttention" not in cpu["decode"]
    nodes = graph_nodes(out, ["decode", "verify_k1"], variant="cpu")
    assert nodes["decode"] > sum(cpu["decode"].values()) and set(nodes) == {"decode", "verify_k1"}
    assert main([str(out), "--variant", "cpu"]) == 0


def _head_ops(checkpoint, out):
    return graph_kernel_ops(convert_small(checkpoint, out, dtype="float16", num_speculative_tokens=3), HEAD_GRAPHS)


def test_the_mtp_heads_passes_stay_under_their_kernel_bounds(models, tmp_path):
    ops = _head_ops(models.checkpoint("base"), tmp_path / "f16")
    passes = head_pass_ops(ops, 3)
    assert passes["mtp_propose_k3 / 3"] * 3 <= FP16_PROPOSE_K3_BOUND, ops["mtp_propose_k3"].most_common()
    assert passes["(verify_mtp_k3 - verify_select_k3) / 3"] * 3 <= FP16_FUSED_HEAD_K3_BOUND
    draft_pass = ops["mtp_propose_k3"] - ops["mtp_propose_k2"]  # one more draft pass: its layer and lm_head alone
    assert not {"Range", "LessOrEqual", "Where", "Expand", "Min", "Transpose"} & set(draft_pass), draft_pass
    assert draft_pass["Concat"] == 1 and draft_pass["Add"] == 1  # the fc's input; the scores' bias
    assert ops["mtp_propose_k3"]["Transpose"] == 2  # the catch-up's new KV rows; its last row attends as a draft pass


def test_the_head_bound_catches_per_pass_masks(models, tmp_path, monkeypatch):
    """Planted: each draft pass (and the catch-up's last row) builds its own mask, bias and indices again."""
    def per_pass(g, spec, positions, passes, slots, scatter_from=0):
        columns = g.op("Split", [positions, g.const([1] * passes)], num_outputs=passes, axis=1) if passes > 1 else [
            positions]
        return [layers.make_step_inputs(g, spec, column, 0, rows=1, slots=slots) for column in columns]

    monkeypatch.setattr(graphs, "make_one_row_steps", per_pass)
    ops = _head_ops(models.checkpoint("base"), tmp_path / "planted")
    assert sum(ops["mtp_propose_k3"].values()) > FP16_PROPOSE_K3_BOUND
