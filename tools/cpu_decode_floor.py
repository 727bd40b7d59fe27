"""A CPU decode against its weight products alone and against the peer's decode graph.

    python tools/cpu_decode_floor.py MODEL_DIR [--peer PEER_DIR/model.onnx] [--graph decode]
                                     [--batch 1] [--threads 1] [--position 80] [--rounds 8] [--block 50]

Three Runs of one step, each in its own session: our graph (the CPU variant a CPU Session runs,
tools/cpu_op_profile.py's feeds), a graph of only its MatMuls against weights (the same weights,
shared: what reading them costs, the floor a graph of this formulation cannot go below), and with
--peer onnxruntime-genai's decode graph (its builder's export: tools/peer/export.py) at the same
past length with random states. They run interleaved in warm blocks of --block Runs (each Run's
weights then come from the caches as in a generate call, where one graph runs step after step);
the table gives wall and process CPU time, minimum and median, and the medians' ratio to ours.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from ortspec.manifest import WEIGHTS_FILE, Manifest  # noqa: E402
from ortspec.runtime.arrays import HostArrays  # noqa: E402
from ortspec.runtime.graphs import SharedWeights  # noqa: E402
from tools.cpu_op_profile import GraphProbe  # noqa: E402


def floor_model(manifest: Manifest, graph: str, batch: int) -> tuple[onnx.ModelProto, list[str], dict]:
    """Every MatMul of the graph's CPU variant whose right operand is a weight, alone, each on an
    input of ones [batch, 1, K]: (model, weight names, feeds). The weights are external data in
    weights.bin, which the session gets as shared initializers."""
    source = onnx.load(str(manifest.dir / manifest.graph_entry(graph, "cpu")["file"]), load_external_data=False)
    weights = [n.input[1] for n in source.graph.node if n.op_type == "MatMul" and n.input[1] in manifest.weights]
    inputs, nodes = {}, []
    for i, name in enumerate(weights):
        K = manifest.weights[name]["shape"][0]
        inputs.setdefault(K, helper.make_tensor_value_info(f"x{K}", TensorProto.FLOAT, [batch, 1, K]))
        nodes.append(helper.make_node("MatMul", [f"x{K}", name], [f"y{i}"]))
    outputs = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None) for i in range(len(weights))]
    model = helper.make_model(helper.make_graph(nodes, "floor", list(inputs.values()), outputs),
                              opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    for name in weights:
        entry = manifest.weights[name]
        tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=entry["shape"])
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", WEIGHTS_FILE), ("offset", entry["offset"]), ("length", entry["length"])):
            tensor.external_data.add(key=key, value=str(value))
        model.graph.initializer.append(tensor)
    return model, weights, {f"x{K}": np.ones((batch, 1, K), np.float32) for K in inputs}


def peer_feeds(session: ort.InferenceSession, batch: int, past: int, head_size: int) -> dict:
    """The peer decode's inputs for one token after `past` tokens: random KV and GDN states
    (its caches' last axis, "kv_cache_dim", is the attention head size of its genai_config.json)."""
    rng, feeds = np.random.default_rng(0), {}
    sizes = {"batch_size": batch, "past_sequence_length": past, "kv_cache_dim": head_size}
    for i in session.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = np.full((batch, 1), 5, np.int64)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((batch, past + 1), np.int64)
        elif i.name == "position_ids":  # [3, B, 1]: the same text position in each rotary section
            feeds[i.name] = np.full((3, batch, 1), past, np.int64)
        else:
            shape = [d if isinstance(d, int) else sizes[d] for d in i.shape]
            feeds[i.name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
    return feeds


def timed(run) -> tuple[float, float]:
    start, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - start, time.process_time() - cpu


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--peer", type=Path, help="the peer's decode graph (model.onnx of its CPU export)")
    parser.add_argument("--graph", default="decode")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--position", type=int, default=80, help="tokens before the step (KV slots in use)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block", type=int, default=50, help="Runs of one graph in a row")
    args = parser.parse_args(argv)
    manifest = Manifest.load(args.model)
    weights = SharedWeights(manifest, HostArrays())
    ours = GraphProbe(manifest, weights, args.graph, argparse.Namespace(variant="cpu", threads=args.threads,
                                                                        batch=args.batch, position=args.position),
                      profile=False)
    model, names, floor_inputs = floor_model(manifest, args.graph, args.batch)
    floor_path = Path(args.model) / f".floor_{args.graph}.onnx"  # beside weights.bin, which it reads
    onnx.save(model, str(floor_path))
    try:
        floor = ort.InferenceSession(str(floor_path), weights.session_options(names, args.threads),
                                     providers=["CPUExecutionProvider"])
    finally:
        floor_path.unlink()
    probes = {"ortspec " + args.graph: lambda: ours.session.run(None, ours.feeds),
              f"its {len(names)} weight MatMuls alone": lambda: floor.run(None, floor_inputs)}
    if args.peer:
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads, options.log_severity_level = args.threads, 1, 3
        peer = ort.InferenceSession(str(args.peer), options, providers=["CPUExecutionProvider"])
        head_size = json.loads((args.peer.parent / "genai_config.json").read_text())["model"]["decoder"]["head_size"]
        feeds = peer_feeds(peer, args.batch, args.position, head_size)
        probes["peer decode"] = lambda: peer.run(None, feeds)
    times = {name: ([], []) for name in probes}
    for _ in range(args.rounds):
        for name, run in probes.items():
            for _ in range(args.block):
                for kind, value in zip(times[name], timed(run)):
                    kind.append(value)
    base = [statistics.median(t) for t in times["ortspec " + args.graph]]
    print(f"{args.model}: batch {args.batch}, {args.threads} thread(s), position {args.position}, "
          f"{args.rounds} rounds of {args.block}\n")
    print("| Run | wall ms min / median | CPU ms min / median | median / ours (wall, CPU) |\n|---|---|---|---|")
    for name, (wall, cpu) in times.items():
        print(f"| {name} | {1e3 * min(wall):.3f} / {1e3 * statistics.median(wall):.3f} | {1e3 * min(cpu):.3f} / "
              f"{1e3 * statistics.median(cpu):.3f} | {statistics.median(wall) / base[0]:.2f}, "
              f"{statistics.median(cpu) / base[1]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
