"""Where a CPU forward spends its time, by op type: decode against verify_select graphs.

    python tools/cpu_op_profile.py MODEL_DIR [--graphs decode,verify_select_k1,verify_select_k3] [--runs 30]

Each graph gets its own ONNX Runtime session (one thread, the shared weights as in a Session)
with ONNX Runtime's profiler on; it runs --runs times on one request at positions 40.. and the
kernel times are summed by op type. Prints a table of microseconds per run (the profiler itself
adds overhead, the same for every graph, so compare columns, not absolute numbers).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402

from ortspec.manifest import Manifest  # noqa: E402
from ortspec.runtime.arrays import HostArrays  # noqa: E402
from ortspec.runtime.graphs import SharedWeights  # noqa: E402


def op_times(manifest: Manifest, weights: SharedWeights, name: str, runs: int) -> dict[str, float]:
    options = weights.session_options(manifest.graphs[name]["weights"], 1)
    options.enable_profiling = True
    options.profile_file_prefix = f"/tmp/ortspec_profile_{name}"
    session = ort.InferenceSession(str(manifest.graph_path(name)), options, providers=["CPUExecutionProvider"])
    rows = session.get_inputs()[[i.name for i in session.get_inputs()].index("positions")].shape[1]
    rows = rows if isinstance(rows, int) else 1
    feeds = {}
    for i in session.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = np.full((1, rows), 5, np.int64)
        elif i.name == "positions":
            feeds[i.name] = np.arange(40, 40 + rows)[None]
        else:
            feeds[i.name] = np.zeros([1] + list(i.shape[1:]), np.float32)
    for _ in range(runs):
        session.run(None, feeds)
    by_op: collections.Counter = collections.Counter()
    for event in json.loads(Path(session.end_profiling()).read_text()):
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            by_op[event["args"]["op_name"]] += event["dur"] / runs
    return dict(by_op)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--graphs", default="decode,verify_select_k1,verify_select_k3")
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args(argv)
    manifest = Manifest.load(args.model)
    weights = SharedWeights(manifest, HostArrays())
    names = args.graphs.split(",")
    times = {name: op_times(manifest, weights, name, args.runs) for name in names}
    ops = sorted({op for t in times.values() for op in t}, key=lambda op: -times[names[-1]].get(op, 0))
    print("| op | " + " | ".join(f"{n} us" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    print("| all | " + " | ".join(f"{sum(times[n].values()):,.0f}" for n in names) + " |")
    for op in ops[:12]:
        print(f"| {op} | " + " | ".join(f"{times[n].get(op, 0):,.0f}" for n in names) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
