"""Kernel-launching ops per graph of a converted model: what prices a GPU step.

    python tools/op_count.py MODEL_DIR [MODEL_DIR ...] [--variant cpu]  # converted model directories
    python tools/op_count.py --convert CHECKPOINT --dtype float32,float16 [--activations float32,model] [-k 3]

On the CUDA EP a decode of the 20M model is launch-bound: ~1.6-2 us per kernel, the GPU busy
about half of the step (BENCHMARKS.md, "Where a token's GPU time goes"), so every node removed from the
decode / verify / mtp_propose graphs is time saved. Every node launches a kernel except the
views ONNX Runtime aliases without a copy (``VIEW_OPS``); shape arithmetic that ORT places on
the CPU still counts, so the count is an upper bound that moves one for one with the graph.
The table lists the total, the Casts (a float16/bfloat16 model converted with float32 activations
casts into and out of every product; ``--activations model`` keeps the residual stream in the
model dtype) and the op kinds, most frequent first; below it the MTP head's kernel ops per pass
(``head_pass_ops``). tests/test_op_count.py holds the fp16 decode and the head's passes of a tiny
model under bounds so that a change re-adding casts or per-pass masks and indices fails. --variant cpu
counts the CPU variants a CPU Session runs ({graph}.cpu.onnx) instead of the portable graphs;
there a view is no copy either, but each node still costs ONNX Runtime's dispatch (~0.2-0.3 us
on the CPU), so the "nodes" column counts them all.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import onnx  # noqa: E402

VIEW_OPS = frozenset({"Reshape", "Unsqueeze", "Squeeze", "Shape", "Flatten"})
GRAPHS = ("decode", "decode_sample", "verify_k3", "verify_select_k3", "mtp_propose_k3", "mtp_sample_k3", "verify_mtp_k3",
          "verify_mtp_sample_k3", "prefill")


def kernel_ops(model: onnx.ModelProto) -> collections.Counter:
    """op type -> nodes of that type that launch a kernel (every node but a view)."""
    return collections.Counter(n.op_type for n in model.graph.node if n.op_type not in VIEW_OPS)


def graph_kernel_ops(model_dir: Path, graphs=GRAPHS, variant: str | None = None) -> dict[str, collections.Counter]:
    """graph name -> kernel_ops, for the graphs of ``graphs`` the model directory has (variant
    "cpu": their CPU variants, {graph}.cpu.onnx)."""
    return {name: kernel_ops(model) for name, model in _graphs(model_dir, graphs, variant).items()}


def graph_nodes(model_dir: Path, graphs=GRAPHS, variant: str | None = None) -> dict[str, int]:
    """graph name -> every node, views included."""
    return {name: len(model.graph.node) for name, model in _graphs(model_dir, graphs, variant).items()}


def _graphs(model_dir: Path, graphs, variant: str | None) -> dict[str, onnx.ModelProto]:
    suffix = f".{variant}.onnx" if variant else ".onnx"
    paths = {name: Path(model_dir) / f"{name}{suffix}" for name in graphs}
    return {name: onnx.load(str(path), load_external_data=False) for name, path in paths.items() if path.is_file()}


def head_pass_ops(counts: dict[str, collections.Counter], k: int) -> dict[str, float]:
    """The MTP head's kernel ops per pass, from graph_kernel_ops' counts of a model converted with
    K >= k: mtp_propose_k{k}'s total over its k passes (the catch-up and k-1 draft passes, with the
    positions, masks and indices they share), and what verify_mtp_k{k} adds to verify_select_k{k}
    (the head's k passes, the greedy acceptance and step_ids) over k. Either is left out where a
    graph is missing."""
    total = {name: sum(ops.values()) for name, ops in counts.items()}
    passes = {}
    if f"mtp_propose_k{k}" in total:
        passes[f"mtp_propose_k{k} / {k}"] = total[f"mtp_propose_k{k}"] / k
    if f"verify_mtp_k{k}" in total and f"verify_select_k{k}" in total:
        passes[f"(verify_mtp_k{k} - verify_select_k{k}) / {k}"] = (
            total[f"verify_mtp_k{k}"] - total[f"verify_select_k{k}"]) / k
    return passes


def table(label: str, counts: dict[str, collections.Counter], top: int = 12, nodes: dict[str, int] | None = None) -> str:
    """A markdown table: one row per graph, its total (and every node, views too), its Casts and
    its most frequent op kinds."""
    rows = [f"#### {label}", "", "| graph | kernel ops | nodes | Casts | most frequent |", "|---|---|---|---|---|"]
    for name, ops in counts.items():
        common = ", ".join(f"{op} {n}" for op, n in ops.most_common(top))
        rows.append(f"| {name} | {sum(ops.values())} | {(nodes or {}).get(name, '-')} | {ops['Cast']} | {common} |")
    return "\n".join(rows) + "\n"


def _converted(checkpoint: Path, dtypes: list[str], activations: list[str], k: int, work: Path):
    from ortspec.converter import convert

    for dtype in dtypes:
        for act in activations:
            if act == "model" and dtype == "float32":
                continue  # a float32 model's "model" activations are float32: the same graphs
            out = convert(checkpoint, work / f"{dtype}-{act}", num_speculative_tokens=k, dtype=dtype, max_length=64,
                          activations=act, progress=False)
            yield f"{checkpoint.name}, {dtype}, activations {act}", out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dirs", nargs="*", type=Path, help="converted model directories")
    parser.add_argument("--convert", type=Path, metavar="CHECKPOINT", help="convert this checkpoint first (temporary)")
    parser.add_argument("--dtype", default="float32,float16", help="dtypes to convert --convert in (comma separated)")
    parser.add_argument("--activations", default="float32",
                        help="activations to convert --convert with (comma separated: float32, model)")
    parser.add_argument("-k", type=int, default=3, help="largest k to convert --convert with (default 3)")
    parser.add_argument("--variant", choices=["cpu"], default=None,
                        help="count the CPU variants ({graph}.cpu.onnx, float32 models) instead of the portable graphs")
    args = parser.parse_args(argv)
    if not args.model_dirs and args.convert is None:
        parser.error("give converted model directories or --convert CHECKPOINT")
    graphs = [g.replace("k3", f"k{args.k}") for g in GRAPHS]
    with tempfile.TemporaryDirectory() as work:
        models = [(str(d), d) for d in args.model_dirs]
        if args.convert is not None:
            models += list(_converted(args.convert, args.dtype.split(","), args.activations.split(","), args.k,
                                      Path(work)))
        for label, model_dir in models:
            label += f", {args.variant} variants" if args.variant else ""
            counts = graph_kernel_ops(model_dir, graphs, args.variant)
            print(table(label, counts, nodes=graph_nodes(model_dir, graphs, args.variant)))
            passes = head_pass_ops(counts, args.k)
            if passes:
                print("MTP head, kernel ops per pass: " + ", ".join(f"{n} = {v:.1f}" for n, v in passes.items()) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
