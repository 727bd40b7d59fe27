"""convert(activations="model"): a float16/bfloat16 model keeps its activations in the model dtype.

The residual stream, the embedding rows, the norms on the stream and the projections' inputs
and outputs are float16 (no Cast around a product between two stream ops); the mixers' insides,
every state and the logits stay float32. On the CPU the float16 graphs run, speculative output
equals greedy and the states equal a plain decode's bitwise, as with float32 activations.
"""

from __future__ import annotations

import json
import shutil

import onnx
import onnxruntime as ort
import pytest

import ortspec
from ortspec.cli import main as cli_main
from ortspec.converter import builder
from ortspec.manifest import Manifest
from ortspec.runtime import custom_ops
from ortspec.runtime.graphs import GraphSet
from ortspec.speculative.auto_k import ScriptedK
from ortspec.speculative.exactness import check_speculative, plain_decode_states
from tests.small_models import convert_small
from tools.op_count import graph_kernel_ops

PROMPTS = [[5, 17, 99, 3, 250, 7, 11], [42], [8, 8, 8, 300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
NEW_TOKENS = 30
K = 3
STREAM_OPS = {"SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "Gather", "Concat"}
F16, F32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT


@pytest.fixture(scope="module")
def half(models, tmp_path_factory):
    """The "base" checkpoint (3 GDN layers, 1 attention) in float16, model activations, 2 stages too."""
    return ortspec.convert(models.checkpoint("base"), tmp_path_factory.mktemp("half") / "m", num_speculative_tokens=K,
                           max_length=128, dtype="float16", activations="model", pipeline_stages=2, progress=False)


@pytest.fixture(scope="module")
def graphs(half):
    return GraphSet(Manifest.load(half))


@pytest.fixture(scope="module")
def reference(graphs):
    return plain_decode_states(graphs, PROMPTS, NEW_TOKENS + K + 1, K)


def load(model_dir, graph: str) -> onnx.ModelProto:
    return onnx.load(str(model_dir / f"{graph}.onnx"), load_external_data=False)


def casts_beside_stream_products(model: onnx.ModelProto) -> list[str]:
    """Casts (one or a chain) between a MatMul and a residual-stream op (norm, embedding, the MTP
    concat), either way round: with activations in the model dtype there are none, both sides
    being in that dtype."""
    producer = {out: node for node in model.graph.node for out in node.output}
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def upstream(node):  # the first non-Cast op above a chain of Casts, or None
        while node is not None and node.op_type == "Cast":
            node = producer.get(node.input[0])
        return node

    def downstream(node):  # the non-Cast ops below a chain of Casts
        for after in consumers.get(node.output[0], []):
            yield from downstream(after) if after.op_type == "Cast" else [after]

    found = []
    for matmul in (n for n in model.graph.node if n.op_type == "MatMul"):
        before = producer.get(matmul.input[0])
        origin = upstream(before) if before is not None and before.op_type == "Cast" else None
        if origin is not None and origin.op_type in STREAM_OPS:
            found.append(f"{origin.name} -> Cast -> {matmul.name}")
        casts = [n for n in consumers.get(matmul.output[0], []) if n.op_type == "Cast"]
        found += [f"{matmul.name} -> Cast -> {after.name}" for cast in casts for after in downstream(cast)
                  if after.op_type in STREAM_OPS]
    return found


def test_speculative_equals_greedy(half):
    greedy = ortspec.Session(half).generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    for k in (2, 3):
        assert ortspec.Session(half, num_speculative_tokens=k).generate(PROMPTS, max_new_tokens=NEW_TOKENS) == greedy
    staged = ortspec.Session(half, pipeline_stages=2, num_speculative_tokens=2)
    assert staged.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == greedy


@pytest.mark.parametrize("commit", ["select", "readvance"])
def test_states_equal_a_plain_decode_bitwise(graphs, reference, commit):
    """After every commit, every state (target KV, GDN conv and recurrent, the head's KV, its next
    draft and hidden) equals the plain decode's bit for bit: the one-Run fused step, the head in a
    Run of its own, fixed rows (CUDA's batching) and two pipeline stages."""
    check_speculative(graphs, PROMPTS, NEW_TOKENS, K, commit, p=0.6, reference=reference)
    check_speculative(graphs, PROMPTS, NEW_TOKENS, 2, commit, p=0.6, reference=reference, fused_verify=False,
                      fixed_rows=True)
    stats = check_speculative(graphs, PROMPTS, NEW_TOKENS, K, commit, p=0.6, reference=reference, stages=2)
    assert stats.speculative_row_steps > 20


def test_deferred_hidden_rows_stay_exact(graphs, reference):
    """Auto k's k = 0 stretches keep the target's hidden rows (float16 here) for the head's later
    catch-up, read back a step late in the pipelined loop: the head's state still equals the plain decode's."""
    stats = check_speculative(graphs, PROMPTS, NEW_TOKENS, K, "select", p=0.7, seed=3, reference=reference,
                              fixed_rows=True, pipelined=True, k_chooser=ScriptedK(K, [0, 0, 0, 0, 2, 0, 0, 3]))
    assert stats.pipelined_steps > 5 and sum(stats.steps_by_k[1:]) >= 3, stats.steps_by_k


def test_the_stream_is_float16_and_the_rest_float32(half):
    """No Cast between a product and the stream; one Cast into and one out of each mixer, one on the
    logits; the stream norms' weights float16, the mixers' norms, states and logits float32."""
    decode = load(half, "decode")
    assert casts_beside_stream_products(decode) == []
    ops = graph_kernel_ops(half, ["decode"])["decode"]
    assert ops["Cast"] == 2 * 4 + 1  # 3 GDN layers + 1 attention layer, each cast in and out once; the logits
    types = {t.name: t.data_type for t in decode.graph.initializer}
    assert {types[n] for n in ("embed", "L0.in_norm", "L0.post_norm", "L3.in_norm", "final_norm")} == {F16}
    assert {types[n] for n in ("L3.q_norm", "L3.k_norm", "L0.gdn_norm", "L0.decay_scale", "rope.cos")} == {F32}
    outputs = {o.name: o.type.tensor_type.elem_type for o in decode.graph.output}
    assert outputs["hidden"] == F16 and outputs["logits"] == F32
    assert {t for name, t in outputs.items() if name.startswith(("new_", "conv_", "recurrent_"))} == {F32}
    head = load(half, f"mtp_propose_k{K}")
    assert casts_beside_stream_products(head) == []
    assert {i.name: i.type.tensor_type.elem_type for i in head.graph.input}["hidden"] == F16
    assert Manifest.load(half).activations == "float16"


def test_float32_activations_have_casts_beside_every_product(models, tmp_path):
    """The structural check is not vacuous: a float16 model with float32 activations casts between
    its norms and every projection, and so would a model-dtype graph whose products cast their
    result back to float32 (planted). The default (auto) gives a float16 model its own dtype."""
    f32act = convert_small(models.checkpoint("base"), tmp_path / "f32act", dtype="float16", activations="float32")
    # per layer: into the mixer's and the MLP's first product, out of their last ones; into the lm_head
    assert len(casts_beside_stream_products(load(f32act, "decode"))) == 4 * 4 + 1
    default = convert_small(models.checkpoint("base"), tmp_path / "default", dtype="float16")
    assert casts_beside_stream_products(load(default, "decode")) == []
    assert Manifest.load(default).activations == "float16"


def test_a_product_cast_back_to_float32_is_caught(models, tmp_path, monkeypatch):
    linear = builder.GraphBuilder.linear

    def linear_into_float32(self, x, weight, hint=None, x_dtype=None, out_dtype=None):
        y = linear(self, x, weight, hint, x_dtype=x_dtype, out_dtype=out_dtype)
        return self.op("Cast", [self.op("Cast", [y], to=F32)], to=self.activations)  # planted: a float32 detour

    monkeypatch.setattr(builder.GraphBuilder, "linear", linear_into_float32)
    planted = convert_small(models.checkpoint("base"), tmp_path / "planted", dtype="float16", activations="model")
    assert casts_beside_stream_products(load(planted, "decode"))


def test_a_float32_model_is_unchanged(models, tmp_path):
    """For a float32 model "model" is float32: the same files, bit for bit (the CPU variants too)."""
    plain = convert_small(models.checkpoint("base"), tmp_path / "plain")
    model = convert_small(models.checkpoint("base"), tmp_path / "model", activations="model")
    files = sorted(p.name for p in plain.iterdir() if p.name != "manifest.json")
    assert files == sorted(p.name for p in model.iterdir() if p.name != "manifest.json")
    assert any(name.endswith(".cpu.onnx") for name in files)
    for name in files:
        assert (plain / name).read_bytes() == (model / name).read_bytes(), name
    assert Manifest.load(model).activations == Manifest.load(plain).activations == "float32"


def test_bfloat16_graphs_are_well_typed(models, tmp_path):
    """bfloat16 runs on CUDA only (the CPU has no bfloat16 MatMul): ONNX Runtime's CPU EP still loads
    and type-checks every graph and must stop only at a missing CPU kernel, not at a type error."""
    out = convert_small(models.checkpoint("base"), tmp_path / "bf16", dtype="bfloat16", activations="model")
    assert Manifest.load(out).activations == "bfloat16"
    for graph in ("decode", "verify_select_k1", "mtp_propose_k1", "mtp_sample_k1", "verify_mtp_k1", "prefill"):
        with pytest.raises(Exception, match="Could not find an implementation"):
            ort.InferenceSession(str(out / f"{graph}.onnx"), custom_ops.session_options(),
                                 providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("option,match", [
    (dict(activations="half"), "activations='half' is not supported; use 'auto'"),
    (dict(activations=None), "activations=None is not supported"),
    (dict(activations="model", dtype="float16", quant="int4"), "activations='model' with quant='int4'"),
    (dict(activations="model", dtype="float16", mtp_quant="int4"), "with mtp_quant='int4' is not supported"),
])
def test_bad_activations_are_typed_errors(tmp_path, option, match):
    with pytest.raises(ortspec.ConvertOptionError, match=match):
        convert_small(tmp_path / "no-such-checkpoint", tmp_path / "out", **option)
    assert not (tmp_path / "out").exists()


def test_cli_refuses_a_bad_activations_value(models, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["convert", str(models.checkpoint("base")), str(tmp_path / "out"), "--activations", "half"])
    assert exit_.value.code == 2 and "invalid choice: 'half'" in capsys.readouterr().err
    assert cli_main(["convert", str(models.checkpoint("base")), str(tmp_path / "out"), "--dtype", "float16",
                     "--activations", "model", "-k", "1", "--max-length", "32"]) == 0
    assert Manifest.load(tmp_path / "out").activations == "float16"


def test_manifest_activations_old_and_bad(half, tmp_path):
    """A manifest written before the field reads as float32; a value no conversion writes is refused."""
    old = shutil.copytree(half, tmp_path / "old")
    doc = json.loads((old / "manifest.json").read_text())
    del doc["activations"]
    doc["dtype"] = "float32"  # the old manifest of a float32 model
    (old / "manifest.json").write_text(json.dumps(doc))
    assert Manifest.load(old).activations == "float32"
    doc["dtype"], doc["activations"] = "float16", "bfloat16"
    (old / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ortspec.ModelDirError, match="activations 'bfloat16', which is neither 'float32' nor"):
        Manifest.load(old)


def test_op_count_tables_both_activations(models, capsys):
    """tools/op_count.py --activations float32,model: one table each, the Casts in their own column."""
    from tools.op_count import main as op_count

    assert op_count(["--convert", str(models.checkpoint("base")), "--dtype", "float16", "--activations",
                     "float32,model", "-k", "1"]) == 0
    text = capsys.readouterr().out
    assert "float16, activations float32" in text and "float16, activations model" in text
    decode_rows = [line.split("|")[4].strip() for line in text.splitlines() if line.startswith("| decode |")]  # Casts
    assert decode_rows == [str(4 * 6 + 3), str(2 * 4 + 1)]  # in and out of 3 products a layer, lm_head, embedding


def test_hf_agreement_counts_identical_continuations(models, tmp_path):
    """tools/hf_agreement.py: a float32 model against transformers' float32 greedy agrees on every prompt."""
    from tools.hf_agreement import compare, shared_prefix

    assert shared_prefix([1, 2, 3], [1, 2, 4]) == 2 and shared_prefix([1, 2], [1, 2]) == 2
    [result] = compare(models.checkpoint("base"), [models.converted("base")], 3, 12, "float32")
    assert (result.identical, result.prompts, result.shared_tokens) == (3, 3, 12.0)


def test_gpu_tools_convert_with_the_activations_asked_for(tmp_path, monkeypatch):
    """tools/gpu.py SUBCOMMAND --activations model: every model the subcommand converts gets them
    (int4 conversions keep float32: convert refuses the combination)."""
    from tools import gpu
    from tools.gpu_suite import common

    parse = gpu.build_parser().parse_args
    assert parse(["kernels", "--activations", "model"]).activations == "model" and parse(["check"]).activations == \
        "auto"
    monkeypatch.setattr(common, "ACTIVATIONS", "model")
    assert Manifest.load(common.convert(common.TINY, tmp_path / "f16", dtype="float16", max_length=64)).activations \
        == "float16"
    assert Manifest.load(common.convert(common.TINY, tmp_path / "q4", dtype="float16", max_length=64,
                                        quant="int4")).activations == "float32"
