"""ONNX Runtime's fused CPU kernels against the CPU graphs' own op chains, piece by piece.

    python tools/cpu_fused_ops.py [--threads 1] [--rounds 20]

The CPU graphs (converter/gdn_cpu.py, layers.py's CPU paths) build a GDN layer's conv, gated
output norm and recurrence from plain ops; the peer's CPU export runs com.microsoft
CausalConvWithState, GatedRMSNorm and LinearAttention instead, one node each. Each pair here is
built by the converter's own functions at the trained model's GDN shapes (tools/row_invariance.py:
hidden 384, 8 value heads of 48), for batch 1 and 4 and M = 1 (a decode) and 4 (a k = 3 verify,
with the state after each row, as the select commit needs: the fused conv's per-row states by
data movement, LinearAttention once per row). Both sides of a pair run the same feeds, interleaved
in blocks of 50 calls; the table gives each side's minimum and median thread CPU microseconds per
call and its node count. Which ops keep a token's bits the same in a decode and a verify row is
tools/row_invariance.py's table; this one is only what each costs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402

from ortspec.converter import gdn_cpu, layers  # noqa: E402
from ortspec.converter.builder import CPU, PORTABLE, GraphBuilder, WeightStore  # noqa: E402
from tools.row_invariance import F32, _gdn_spec, _normal  # noqa: E402

SPEC = _gdn_spec()
C, K, NK, NV = SPEC.conv_dim, SPEC.linear_conv_kernel_dim, SPEC.linear_num_key_heads, SPEC.linear_num_value_heads
DK, DV, KD, VD = SPEC.linear_key_head_dim, SPEC.linear_value_head_dim, SPEC.linear_key_dim, SPEC.linear_value_dim
SHAPES = [(b, m) for b in (1, 4) for m in (1, 4)]  # (batch, rows)


def conv_chain(g, rows):
    x, state = g.input("x", F32, ["B", rows, C]), g.input("s", F32, ["B", K - 1, C])
    out, states = gdn_cpu._conv_rows(g, SPEC, "conv_taps", state, x, rows, windows=rows > 1)
    return [out, *(states if rows > 1 else [states])]


def conv_fused(g, rows):
    x, state = g.input("x", F32, ["B", rows, C]), g.input("s", F32, ["B", K - 1, C])
    out, last = g.ms("CausalConvWithState", [x, g.weight("conv"), "", state], num_outputs=2, activation="silu",
                     channels_last=1)
    if rows == 1:
        return [out, last]
    inputs = g.op("Concat", [state, x], axis=1)  # the state after row j: inputs j+1 .. j+K-1
    return [out, *(g.op("Slice", [inputs, g.const([j + 1]), g.const([j + K]), g.const([1])]) for j in range(rows))]


def norm_chain(g, rows):
    core, z = g.input("x", F32, ["B", rows, VD]), g.input("z", F32, ["B", rows, VD])
    heads = g.op("Reshape", [core, g.const([0, 0, NV, DV])])
    return [layers.make_gated_norm_chain(g, SPEC, heads, z, "gdn_norm")]


def norm_fused(g, rows):
    core, z = g.input("x", F32, ["B", rows, VD]), g.input("z", F32, ["B", rows, VD])
    return [g.ms("GatedRMSNorm", [core, g.weight("gdn_norm"), z], activation="silu", epsilon=SPEC.rms_norm_eps)]


def _recurrence_inputs(g, rows):
    names = (("q", KD), ("k", KD), ("v", VD), ("d", NV), ("b", NV))
    return [g.input(n, F32, ["B", rows, width]) for n, width in names] + [g.input("s", F32, ["B", NV, DK, DV])]


def recurrence_chain(g, rows):
    q, k, v, decay, beta, state = _recurrence_inputs(g, rows)
    heads, states = gdn_cpu._recurrence_rows(g, SPEC, state, q, k, v, decay, beta, rows, windows=rows > 1)
    return [heads, *(states if rows > 1 else [states])]


def recurrence_fused(g, rows):
    q, k, v, decay, beta, state = _recurrence_inputs(g, rows)
    q, k = (g.op("Reshape", [layers.l2_normalize(g, t, NK, DK), g.const([0, 0, KD])]) for t in (q, k))

    def recurrence(s, *row):
        return g.ms("LinearAttention", [*row[:3], s, *row[3:]], num_outputs=2, q_num_heads=NK, kv_num_heads=NV,
                    update_rule="gated_delta", scale=float(DK ** -0.5))

    if rows == 1:
        return list(recurrence(state, q, k, v, decay, beta))
    return list(layers._recurrence_per_row(g, recurrence, state, [q, k, v, decay, beta], rows))


PIECES = {"conv": (conv_chain, conv_fused, "CausalConvWithState"),
          "gated norm": (norm_chain, norm_fused, "GatedRMSNorm"),
          "recurrence": (recurrence_chain, recurrence_fused, "LinearAttention")}


def piece_feeds(name: str, rng, batch: int, rows: int) -> dict:
    """A piece's inputs: rows of its width, a state where it has one (decays negative: log space)."""
    if name == "conv":
        return {"x": _normal(rng, batch, rows, C), "s": _normal(rng, batch, K - 1, C)}
    if name == "gated norm":
        return {"x": _normal(rng, batch, rows, VD), "z": _normal(rng, batch, rows, VD)}
    return {"q": _normal(rng, batch, rows, KD), "k": _normal(rng, batch, rows, KD), "v": _normal(rng, batch, rows, VD),
            "d": -np.abs(_normal(rng, batch, rows, NV)), "b": _normal(rng, batch, rows, NV),
            "s": _normal(rng, batch, NV, DK, DV, scale=0.1)}


def session(build, rows: int, threads: int, work: Path) -> tuple[ort.InferenceSession, int]:
    """The piece as a graph of its own (CPU target for the chains; the fused ops are the same
    nodes either way) and its node count."""
    store, rng = WeightStore(), np.random.default_rng(0)
    store.add("conv_taps", _normal(rng, K, C, scale=0.5))
    store.add("conv", np.ascontiguousarray(store.arrays["conv_taps"].T[:, None, :]))  # [C, 1, K]
    store.add("gdn_norm", 1 + _normal(rng, DV, scale=0.1))
    g = GraphBuilder("piece", store, CPU if build in (conv_chain, norm_chain, recurrence_chain) else PORTABLE)
    for i, value in enumerate(build(g, rows)):
        g.output(value, f"out{i}", F32, None)
    directory = Path(tempfile.mkdtemp(dir=work))
    onnx.save(g.build(store.save(directory)), str(directory / "piece.onnx"))
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = threads, 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(directory / "piece.onnx"), options, providers=["CPUExecutionProvider"]), len(g.nodes)


def cpu_us(runs: list[float]) -> str:
    return f"{1e6 * min(runs):.1f} / {1e6 * statistics.median(runs):.1f}"


def measure(name: str, batch: int, rows: int, threads: int, rounds: int, work: Path) -> list:
    chain, fused, op = PIECES[name]
    (a, nodes_a), (b, nodes_b) = session(chain, rows, threads, work), session(fused, rows, threads, work)
    inputs = piece_feeds(name, np.random.default_rng(1), batch, rows)
    times = ([], [])
    for _ in range(rounds):
        for s, t in zip((a, b), times):
            for _ in range(50):
                start = time.thread_time()
                s.run(None, inputs)
                t.append(time.thread_time() - start)
    return [name, op, batch, rows, f"{cpu_us(times[0])} ({nodes_a})", f"{cpu_us(times[1])} ({nodes_b})",
            f"{statistics.median(times[1]) / statistics.median(times[0]):.2f}"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=20, help="blocks of 50 calls per side")
    args = parser.parse_args(argv)
    print(f"onnxruntime {ort.__version__}, CPU EP, {args.threads} thread(s); us per call: min / median (nodes)\n")
    print("| piece | fused op | batch | rows | CPU graphs' chain | fused op | fused / chain (median) |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as work:
        for name in PIECES:
            for batch, rows in SHAPES:
                print("| " + " | ".join(map(str, measure(name, batch, rows, args.threads, args.rounds, Path(work))))
                      + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
