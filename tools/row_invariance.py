"""Which ops give a token the same bits whatever rows share the call (ONNX Runtime, CPU EP).

    python tools/row_invariance.py [--threads 1,2]

Exact speculative decoding on the CPU needs every op of the graphs to compute a token's row
the same way in the M=1 decode and the M=k+1 verify. This builds each op kind as the converter
uses it (the model's own shapes: hidden 384, 8 GDN heads of 48, attention head dim 64 over
1024 cache slots), runs M rows of one request in one call and the same rows one call each
(M = 1..5), and prints whether every row is bitwise the same. ``cases()`` also holds variants
the converter avoids, so the table shows why. tests/test_row_invariance.py asserts the ones the
graphs rely on.

For a recurrent op (LinearAttention, CausalConvWithState) "one call each" means row after row
through the state, and the state after the last row must match too. The last lines check that
the attention's bits do not depend on how many cache slots past the rows' positions it is given,
and that the GDN layer of the CPU graphs (converter/gdn_cpu.py: ops chained per row, built at
a static M) gives the same bits in a verify over M rows (outputs, and the state after each row)
as in M one-row decodes.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from ortspec.converter.builder import CPU, GraphBuilder, WeightStore  # noqa: E402
from ortspec.converter.gdn_cpu import make_gated_deltanet_rows  # noqa: E402
from ortspec.converter.quantize import quantize_int4  # noqa: E402
from ortspec.model_spec import ModelSpec  # noqa: E402

F32 = TensorProto.FLOAT
ROWS = range(1, 6)
BATCH = 1  # one request: a one-row call is then a one-row product


@dataclasses.dataclass
class Case:
    """One op kind: a single-node graph whose ``rows`` inputs have M token rows on ``row_axis``
    (the others, e.g. a KV cache, are shared by every row) and, for a recurrent op, a state
    input that a one-row call passes on to the next."""

    op: str
    used: str  # where the graphs use it, or why they avoid it
    node: helper.NodeProto
    inputs: Callable[[np.random.Generator, int], dict]  # (rng, M) -> feeds
    rows: tuple[str, ...]  # the inputs that carry token rows
    constants: dict = dataclasses.field(default_factory=dict)
    state: tuple[str, str] | None = None  # (state input, state output) of a recurrent op
    row_axis: int = 1
    relied_on: bool = True  # False: a variant the converter avoids
    int64_inputs: tuple[str, ...] = ()  # inputs that are int64 (positions), the rest float32


def _session(case: Case, threads: int) -> ort.InferenceSession:
    names = [n for n in case.node.input if n and n not in case.constants]
    types = {n: TensorProto.INT64 if n in case.int64_inputs else F32 for n in names}
    graph = helper.make_graph([case.node], case.op, [helper.make_tensor_value_info(n, types[n], None) for n in names],
                              [helper.make_tensor_value_info(n, F32, None) for n in case.node.output],
                              [numpy_helper.from_array(v, n) for n, v in case.constants.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def row_invariant(case: Case, threads: int = 1, seed: int = 0) -> bool:
    """M rows in one call == the same rows one call each (through the state), every M in ROWS."""
    session, rng = _session(case, threads), np.random.default_rng(seed)
    outputs = [o.name for o in session.get_outputs()]
    for m in ROWS:
        feeds = case.inputs(rng, m)
        together = dict(zip(outputs, session.run(None, feeds)))
        state = feeds.get(case.state[0]) if case.state else None
        for j in range(m):
            one = {n: np.ascontiguousarray(np.take(v, [j], axis=case.row_axis)) if n in case.rows else v
                   for n, v in feeds.items()}
            if case.state:
                one[case.state[0]] = state
            alone = dict(zip(outputs, session.run(None, one)))
            for name in outputs:
                if case.state and name == case.state[1]:
                    continue
                if not np.array_equal(np.take(together[name], [j], axis=case.row_axis), alone[name]):
                    return False
            state = alone[case.state[1]] if case.state else None
        if case.state and not np.array_equal(together[case.state[1]], state):
            return False
    return True


def _normal(rng, *shape, scale=1.0) -> np.ndarray:
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def _l2_rows(x: np.ndarray, heads: int) -> np.ndarray:
    xh = x.reshape(*x.shape[:-1], heads, -1)
    return (xh / np.sqrt((xh ** 2).sum(-1, keepdims=True) + 1e-6)).reshape(x.shape).astype(np.float32)


def _ms(op: str, inputs, outputs, **attrs) -> helper.NodeProto:
    return helper.make_node(op, inputs, outputs, domain="com.microsoft", **attrs)


def cases(seed: int = 0) -> list[Case]:
    rng = np.random.default_rng(seed)
    H, L, hd, nk, nv, dk, C = 384, 1024, 64, 4, 8, 48, 768
    weight = _normal(rng, H, 1168, scale=0.05)

    def nbits(level: int, block: int = 32) -> Case:
        packed, scales = quantize_int4(weight, block)
        used = "int4 projections" if (level, block) == (4, 32) else "not used"
        return Case(f"MatMulNBits accuracy_level {level}" + (f", block {block}" if block != 32 else ""), used,
                    _ms("MatMulNBits", ["x", "w", "s"], ["y"], K=H, N=1168, bits=4, block_size=block,
                        accuracy_level=level), lambda r, m: {"x": _normal(r, BATCH, m, H)}, ("x",),
                    {"w": packed, "s": scales}, relied_on=used != "not used")

    # attention products: queries of one KV head as rows [B, kvh, R, hd] against the merged cache
    keys, values = _normal(rng, BATCH, 2, hd, L), _normal(rng, BATCH, 2, L, hd)
    angles = (np.arange(L)[:, None] * 10000.0 ** (-np.arange(8) / 8)).astype(np.float32)  # RoPE tables [L, 16/2]
    return [
        Case("MatMul, constant weight", "projections, MLP, lm_head (fp32)", helper.make_node("MatMul", ["x", "w"], ["y"]),
             lambda r, m: {"x": _normal(r, BATCH, m, H)}, ("x",), {"w": _normal(rng, H, 1168, scale=0.05)}),
        Case("MatMul, computed right operand", "not used: one row takes another kernel",
             helper.make_node("MatMul", ["q", "k"], ["y"]), lambda r, m: {"q": _normal(r, BATCH, 2, m, hd), "k": keys},
             ("q",), row_axis=2, relied_on=False),
        Case("FusedMatMul alpha=1/8, computed right operand", "attention scores",
             _ms("FusedMatMul", ["q", "k"], ["y"], alpha=hd ** -0.5),
             lambda r, m: {"q": _normal(r, BATCH, 2, m, hd), "k": keys}, ("q",), row_axis=2),
        Case("FusedMatMul alpha=2, computed right operand", "attention context (o_proj stored halved)",
             _ms("FusedMatMul", ["p", "v"], ["y"], alpha=2.0),
             lambda r, m: {"p": np.abs(_normal(r, BATCH, 2, m, L)) / L, "v": values}, ("p",), row_axis=2),
        nbits(4), nbits(0), nbits(4, 64), nbits(4, 128),
        Case("LinearAttention gated_delta, 4 q/k heads for 8 v heads", "GDN recurrence", _ms(
            "LinearAttention", ["q", "k", "v", "s", "g", "b"], ["o", "so"], q_num_heads=nk, kv_num_heads=nv,
            update_rule="gated_delta", scale=float(dk ** -0.5)),
            lambda r, m: {"q": _l2_rows(_normal(r, BATCH, m, nk * dk), nk), "k": _l2_rows(_normal(r, BATCH, m, nk * dk), nk),
                          "v": _normal(r, BATCH, m, nv * dk), "s": _normal(r, BATCH, nv, dk, dk, scale=0.1),
                          "g": -np.abs(_normal(r, BATCH, m, nv)), "b": np.abs(_normal(r, BATCH, m, nv)) % 1},
            ("q", "k", "v", "g", "b"), state=("s", "so")),
        Case("CausalConvWithState silu", "GDN conv", _ms(
            "CausalConvWithState", ["x", "w", "", "s"], ["y", "so"], activation="silu", channels_last=1),
            lambda r, m: {"x": _normal(r, BATCH, m, C), "s": _normal(r, BATCH, 3, C)}, ("x",),
            {"w": _normal(rng, C, 1, 4)}, state=("s", "so")),
        Case("GatedRMSNorm silu", "GDN output norm", _ms("GatedRMSNorm", ["x", "w", "z"], ["y"], activation="silu",
                                                          epsilon=1e-6),
             lambda r, m: {"x": _normal(r, BATCH, m, nv * dk), "z": _normal(r, BATCH, m, nv * dk)}, ("x", "z"),
             {"w": _normal(rng, dk)}),
        Case("SimplifiedLayerNormalization, weight 1/sqrt(d)", "GDN q/k l2norm", helper.make_node(
            "SimplifiedLayerNormalization", ["x", "w"], ["y"], axis=-1, epsilon=1e-6 / dk, stash_type=1),
             lambda r, m: {"x": _normal(r, BATCH, m, nk, dk)}, ("x",), {"w": np.full(dk, dk ** -0.5, np.float32)}),
        Case("RotaryEmbedding, partial rotary", "attention q/k RoPE", _ms(
            "RotaryEmbedding", ["x", "p", "cos", "sin"], ["y"], num_heads=6, rotary_embedding_dim=16, interleaved=0),
             lambda r, m: {"x": _normal(r, BATCH, m, 6 * hd), "p": r.integers(0, L, (BATCH, m))}, ("x", "p"),
             {"cos": np.cos(angles), "sin": np.sin(angles)}, int64_inputs=("p",)),
        Case("ScaledSiLU alpha=1", "MLP activation (portable graphs)", _ms("ScaledSiLU", ["x"], ["y"], alpha=1.0),
             lambda r, m: {"x": _normal(r, BATCH, m, 1024)}, ("x",)),
        Case("QuickGelu alpha=1", "SiLU of the CPU graphs (MLP, GDN conv and gate)", _ms("QuickGelu", ["x"], ["y"],
                                                                                         alpha=1.0),
             lambda r, m: {"x": _normal(r, BATCH, m, 1024)}, ("x",)),
        Case("ReduceSum over the conv taps", "GDN conv of the CPU graphs ([B, M, K, C] -> [B, M, C])",
             helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0),
             lambda r, m: {"x": _normal(r, BATCH, m, 4, C)}, ("x",), {"axes": np.array([2])}),
        Case("Softmax", "attention", helper.make_node("Softmax", ["x"], ["y"], axis=-1),
             lambda r, m: {"x": _normal(r, BATCH, 2, m, L)}, ("x",), row_axis=2),
    ]


WINDOWS = (61, 64, 128, 1024)  # cache slots attended over; the rows' positions all lie below the first


def window_invariant(threads: int = 1, seed: int = 0) -> bool:
    """make_attention's chain (scores FusedMatMul + -inf mask, Softmax, context FusedMatMul) over
    the first W cache slots gives the same bits for every W in WINDOWS past the rows' positions:
    masked slots get probability exactly 0 and add exact zeros. This is what lets the CPU runtime
    pass a window of the cache instead of all max_length slots."""
    hd, rows, live = 64, 6, WINDOWS[0]
    nodes = [helper.make_node("FusedMatMul", ["q", "k"], ["s"], domain="com.microsoft", alpha=hd ** -0.5),
             helper.make_node("Add", ["s", "bias"], ["masked"]), helper.make_node("Softmax", ["masked"], ["p"], axis=-1),
             helper.make_node("FusedMatMul", ["p", "v"], ["ctx"], domain="com.microsoft", alpha=2.0)]
    graph = helper.make_graph(nodes, "window", [helper.make_tensor_value_info(n, F32, None) for n in "q k v bias".split()],
                              [helper.make_tensor_value_info("ctx", F32, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    q, keys, values = _normal(rng, 1, 2, rows, hd), _normal(rng, 1, 2, hd, WINDOWS[-1]), _normal(rng, 1, 2, WINDOWS[-1], hd)
    positions = rng.integers(0, live, rows)  # each row sees slots <= its position
    outputs = []
    for w in WINDOWS:
        bias = np.where(np.arange(w)[None, :] <= positions[:, None], 0.0, -np.inf).astype(np.float32)[None, None]
        outputs.append(session.run(None, {"q": q, "k": np.ascontiguousarray(keys[..., :w]),
                                          "v": np.ascontiguousarray(values[:, :, :w]), "bias": bias})[0])
    return all(np.array_equal(outputs[0], o) for o in outputs[1:])


def gqa_rows_invariant(threads: int = 1, seed: int = 0, past: int = 20) -> bool:
    """com.microsoft GroupQueryAttention (the peer's CPU attention), M new rows over a past of
    `past` slots in one call against M one-row calls, each row's key and value appended to the
    past (present_key/present_value) before the next: the same bits for every row? The CPU
    graphs do not use it (they run FusedMatMul over a merged cache view: make_attention)."""
    nh, kvh, hd = 6, 2, 64
    node = _ms("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "seqlens", "total"], ["o", "ok", "ov"],
               num_heads=nh, kv_num_heads=kvh, scale=hd ** -0.5)
    types = dict.fromkeys(("q", "k", "v", "pk", "pv"), F32) | {"seqlens": TensorProto.INT32, "total": TensorProto.INT32}
    graph = helper.make_graph([node], "gqa", [helper.make_tensor_value_info(n, t, None) for n, t in types.items()],
                              [helper.make_tensor_value_info(n, F32, None) for n in node.output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = threads, 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    for m in ROWS:
        q, k, v = _normal(rng, 1, m, nh * hd), _normal(rng, 1, m, kvh * hd), _normal(rng, 1, m, kvh * hd)
        key, value = _normal(rng, 1, kvh, past, hd), _normal(rng, 1, kvh, past, hd)
        together = session.run(None, {"q": q, "k": k, "v": v, "pk": key, "pv": value,
                                      "seqlens": np.array([past + m - 1], np.int32),
                                      "total": np.array(past + m, np.int32)})[0]
        for j in range(m):
            alone, key, value = session.run(None, {"q": q[:, j:j + 1], "k": k[:, j:j + 1], "v": v[:, j:j + 1],
                                                   "pk": key, "pv": value, "seqlens": np.array([past + j], np.int32),
                                                   "total": np.array(past + j + 1, np.int32)})
            if not np.array_equal(together[:, j:j + 1], alone):
                return False
    return True


GDN_ROWS = range(1, 6)  # verify widths M checked for the CPU graphs' GDN layer


def gdn_rows_invariant(threads: int = 1, seed: int = 0, batch: int = 2) -> bool:
    """The CPU graphs' GDN layer (gdn_cpu.make_gated_deltanet_rows, the model's own shapes,
    random weights) over M rows with state windows gives each row the same bits, output and
    states after it, as M one-row decodes chained through the states, for M in GDN_ROWS."""
    decode, rng = _gdn_session(1, False, threads, seed), np.random.default_rng(seed)
    for m in GDN_ROWS:
        feeds = _gdn_feeds(rng, batch, m)
        verify = _gdn_session(m, True, threads, seed)
        out = dict(zip([o.name for o in verify.get_outputs()], verify.run(None, feeds)))  # y [B, M, H]; states per row
        state = {"conv": feeds["conv"], "rec": feeds["rec"]}
        for j in range(m):
            one, state["conv"], state["rec"] = decode.run(None, {"x": feeds["x"][:, j: j + 1], **state})
            if not (np.array_equal(one, out["y"][:, j: j + 1]) and np.array_equal(state["conv"], out[f"conv_out.{j}"])
                    and np.array_equal(state["rec"], out[f"rec_out.{j}"])):
                return False
    return True


def _gdn_spec() -> ModelSpec:
    """One GDN layer of the model's own GDN shapes (hidden 384, 4 key heads and 8 value heads of 48, kernel 4)."""
    return ModelSpec.from_hf_config({
        "model_type": "qwen3_5_text", "hidden_size": 384, "num_hidden_layers": 1, "layer_types": ["linear_attention"],
        "vocab_size": 64, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 48,
        "linear_value_head_dim": 48, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6})


def _gdn_session(rows: int, windows: bool, threads: int, seed: int) -> ort.InferenceSession:
    """The CPU graphs' GDN layer alone: x [B, rows, H], conv, rec -> y, conv_out, rec_out (windows: the
    state after each row j, conv_out.{j} and rec_out.{j})."""
    spec, store, rng = _gdn_spec(), WeightStore(), np.random.default_rng(seed)
    H, C, nv, dv, vd = spec.hidden_size, spec.conv_dim, spec.linear_num_value_heads, spec.linear_value_head_dim, \
        spec.linear_value_dim
    store.add("L.in_proj", _normal(rng, H, C + vd + 2 * nv, scale=H ** -0.5))
    store.add("L.conv_taps", _normal(rng, spec.linear_conv_kernel_dim, C, scale=0.5))
    store.add("L.dt_bias", _normal(rng, nv))
    store.add("L.decay_scale", -np.exp(_normal(rng, nv, scale=0.5)))
    store.add("L.gdn_norm", 1 + _normal(rng, dv, scale=0.1))
    store.add("L.out", _normal(rng, vd, H, scale=vd ** -0.5))
    g = GraphBuilder("gdn_rows", store, CPU)
    x = g.input("x", F32, ["B", rows, H])
    conv = g.input("conv", F32, ["B", spec.linear_conv_kernel_dim - 1, C])
    rec = g.input("rec", F32, ["B", nv, spec.linear_key_head_dim, dv])
    outputs = make_gated_deltanet_rows(g, spec, x, "L", conv, rec, rows, windows)
    for value, name in zip(outputs, ("y", "conv_out", "rec_out")):
        for j, row in enumerate(value if isinstance(value, list) else [value]):
            g.output(row, f"{name}.{j}" if isinstance(value, list) else name, F32, None)
    directory = Path(tempfile.mkdtemp(prefix="row_invariance_"))
    onnx.save(g.build(store.save(directory)), str(directory / "gdn.onnx"))  # weights.bin beside it
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    return ort.InferenceSession(str(directory / "gdn.onnx"), options, providers=["CPUExecutionProvider"])


def _gdn_feeds(rng, batch: int, rows: int) -> dict:
    spec = _gdn_spec()
    return {"x": _normal(rng, batch, rows, spec.hidden_size),
            "conv": _normal(rng, batch, spec.linear_conv_kernel_dim - 1, spec.conv_dim),
            "rec": _normal(rng, batch, spec.linear_num_value_heads, spec.linear_key_head_dim,
                           spec.linear_value_head_dim, scale=0.1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2")
    args = parser.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    print(f"onnxruntime {ort.__version__}, CPU EP; M = {ROWS.start}..{ROWS.stop - 1} rows, batch {BATCH}\n")
    print("| op | where | " + " | ".join(f"row-invariant, {t} thread{'s' * (t > 1)}" for t in threads) + " |")
    print("|---|---|" + "---|" * len(threads))
    for case in cases():
        print(f"| {case.op} | {case.used} | " + " | ".join("yes" if row_invariant(case, t) else "**no**"
                                                          for t in threads) + " |")
    print(f"| attention over the first W cache slots, W = {', '.join(map(str, WINDOWS))} | KV window (CPU runtime) | "
          + " | ".join("same bits" if window_invariant(t) else "**differs**" for t in threads) + " |")
    print("| GroupQueryAttention, M rows vs one-row calls through its KV | not used (the CPU graphs attend with "
          "FusedMatMul over a merged cache view) | " + " | ".join("yes" if gqa_rows_invariant(t) else "**no**"
                                                                  for t in threads) + " |")
    print(f"| GDN layer of the CPU graphs, M = {GDN_ROWS.start}..{GDN_ROWS.stop - 1} rows vs one-row decodes | "
          "decode / verify_select (*.cpu.onnx) | " + " | ".join("yes" if gdn_rows_invariant(t) else "**no**"
                                                                for t in threads) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
