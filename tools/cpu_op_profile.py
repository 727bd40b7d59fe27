"""Where a CPU forward spends its time: wall time per graph, and op time by op type.

    python tools/cpu_op_profile.py MODEL_DIR [--graphs decode,verify_select_k1,verify_select_k3]
                                   [--batch 1] [--threads 1] [--runs 30] [--position 100]
                                   [--variant cpu|portable]

Each graph gets its own ONNX Runtime session (the shared weights, as in a Session) and runs on
--batch requests at positions --position.. (the step shape of the graph: M=1 for decode, k+1
for verify_*_k{k} and the catch-up of mtp_propose_k{k}), with random states and the KV window
the CPU runtime would pass (all max_length slots for a model converted without windows).
A graph name may end in @portable or @cpu to pick that variant (default: --variant, i.e. the
graph a CPU Session loads: the CPU variant where the model has one), e.g.
``--graphs decode@portable,decode@cpu`` times both in one interleaved run.

Two tables:
- wall ms per Run without the profiler, graphs interleaved round by round (so machine noise
  hits them alike): median and minimum, and the median's ratio to the first graph; and the
  process CPU time per Run (every intra-op thread), median and ratio;
- op time by op type from ONNX Runtime's profiler: per node the median over the runs (one
  slow run does not move it), summed by op type, with the number of nodes. The profiler adds
  a fixed cost per node, so compare columns, not the sum with the wall table.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402

from ortspec.manifest import Manifest  # noqa: E402
from ortspec.runtime.arrays import HostArrays  # noqa: E402
from ortspec.runtime.graphs import SharedWeights  # noqa: E402
from ortspec.runtime.kv_window import window_slots  # noqa: E402


def step_rows(session: ort.InferenceSession, name: str) -> int:
    """Token rows per request of the graph's step: static M, else k+1 for *_k{k}, else 1."""
    positions = next(i for i in session.get_inputs() if i.name == "positions")
    if isinstance(positions.shape[1], int):
        return positions.shape[1]
    k = re.search(r"_k(\d+)$", name)
    return int(k.group(1)) + 1 if k else 1


def make_feeds(session: ort.InferenceSession, manifest: Manifest, name: str, rows: int, batch: int, position: int,
               seed: int = 0) -> dict:
    """Inputs of one step: token 5 everywhere, positions position.., random finite states, the
    KV caches cut to the window the CPU runtime would pass."""
    rng = np.random.default_rng(seed)
    reach = rows - 1 if name.startswith("mtp_propose") else 1  # the drafts reach k-1 slots past row a
    window = window_slots(manifest.max_length, position + rows - 1, reach) if manifest.attention_window else None
    if name.startswith("verify_mtp") and manifest.attention_window:  # the head's cache: k slots further (Wm)
        head_window = window_slots(manifest.max_length, position + rows - 1, rows - 1)
    else:
        head_window = window
    feeds = {}
    for i in session.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = np.full((batch, rows), 5, np.int64)
        elif i.name == "positions":
            feeds[i.name] = np.tile(np.arange(position, position + rows), (batch, 1))
        elif i.name == "last":
            feeds[i.name] = np.zeros(batch, np.int64)
        elif i.name in manifest.states:
            state = (0.1 * rng.standard_normal([batch] + manifest.states[i.name]["shape"][1:])).astype(np.float32)
            slots = head_window if manifest.states[i.name]["kind"].startswith("mtp_") else window
            if slots is not None and manifest.states[i.name]["kind"].endswith("kv_key"):
                state = state[..., :slots]
            elif slots is not None and manifest.states[i.name]["kind"].endswith("kv_value"):
                state = state[:, :, :slots]
            feeds[i.name] = np.ascontiguousarray(state)
        else:  # the MTP head's hidden input [B, M, H]
            shape = [batch] + [d if isinstance(d, int) else rows for d in i.shape[1:]]
            feeds[i.name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
    return feeds


class GraphProbe:
    """One graph's session and feeds, with and without ONNX Runtime's profiler."""

    def __init__(self, manifest: Manifest, weights: SharedWeights, name: str, args, profile: bool) -> None:
        graph, _, variant = name.partition("@")
        entry = manifest.graph_entry(graph, _provider(variant or args.variant))
        options = weights.session_options(entry["weights"], args.threads)
        if profile:
            options.enable_profiling = True
            options.profile_file_prefix = str(Path(tempfile.gettempdir()) / f"ortspec_profile_{graph}")
        self.name = name
        self.session = ort.InferenceSession(str(manifest.dir / entry["file"]), options,
                                            providers=["CPUExecutionProvider"])
        self.feeds = make_feeds(self.session, manifest, graph, step_rows(self.session, graph), args.batch,
                                args.position)
        for _ in range(3):  # warm-up: first runs allocate
            self.run()

    def run(self) -> tuple[float, float]:
        """(wall seconds, process CPU seconds) of one Run."""
        start, cpu_start = time.perf_counter(), time.process_time()
        self.session.run(None, self.feeds)
        return time.perf_counter() - start, time.process_time() - cpu_start

    def op_times(self) -> dict[str, tuple[float, int]]:
        """op type -> (sum over its nodes of the median kernel us per run, number of nodes)."""
        per_node: dict = collections.defaultdict(list)
        for event in json.loads(Path(self.session.end_profiling()).read_text()):
            if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
                per_node[(event["args"]["op_name"], event["name"])].append(event["dur"])
        by_op: dict = collections.defaultdict(lambda: [0.0, 0])
        for (op, _), durations in per_node.items():
            by_op[op][0] += statistics.median(durations)
            by_op[op][1] += 1
        return {op: (us, n) for op, (us, n) in by_op.items()}


def _provider(variant: str) -> str | None:
    """--variant -> the provider whose graph to load: "cpu" its variant, "portable" none (the portable graph)."""
    if variant not in VARIANTS:
        raise SystemExit(f"variant {variant!r}: use one of {', '.join(VARIANTS)}")
    return "cpu" if variant == "cpu" else None


VARIANTS = ("cpu", "portable")


def wall_table(probes: list[GraphProbe], runs: int) -> str:
    """Wall and process CPU time per Run (the CPU time counts every intra-op thread and moves far
    less than the wall clock when other processes load the machine), medians' ratios to the first graph."""
    times = {p.name: ([], []) for p in probes}
    for _ in range(runs):  # interleaved: every round runs every graph once
        for p in probes:
            for kind, value in zip(times[p.name], p.run()):
                kind.append(value)
    base, cpu_base = (statistics.median(t) for t in times[probes[0].name])
    lines = ["| graph | median ms | min ms | median / first | CPU ms (median) | CPU / first |", "|---|---|---|---|---|---|"]
    for p in probes:
        wall, cpu = times[p.name]
        lines.append(f"| {p.name} | {1e3 * statistics.median(wall):.2f} | {1e3 * min(wall):.2f} | "
                     f"{statistics.median(wall) / base:.2f} | {1e3 * statistics.median(cpu):.2f} | "
                     f"{statistics.median(cpu) / cpu_base:.2f} |")
    return "\n".join(lines)


def op_table(probes: list[GraphProbe], runs: int, top: int) -> str:
    for _ in range(runs):
        for p in probes:
            p.run()
    times = {p.name: p.op_times() for p in probes}
    names = [p.name for p in probes]
    ops = sorted({op for t in times.values() for op in t}, key=lambda op: -max(t.get(op, (0, 0))[0] for t in times.values()))
    lines = ["| op | " + " | ".join(f"{n} us (nodes)" for n in names) + " |", "|---|" + "---|" * len(names),
             "| all | " + " | ".join(f"{sum(us for us, _ in times[n].values()):,.0f} "
                                     f"({sum(c for _, c in times[n].values())})" for n in names) + " |"]
    for op in ops[:top]:
        cells = [f"{times[n][op][0]:,.0f} ({times[n][op][1]})" if op in times[n] else "-" for n in names]
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--graphs", default="decode,verify_select_k1,verify_select_k3")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--position", type=int, default=100, help="first position of the step (KV slots in use)")
    parser.add_argument("--top", type=int, default=14, help="op types listed")
    parser.add_argument("--no-ops", action="store_true", help="wall times only")
    parser.add_argument("--variant", default="cpu", choices=VARIANTS,
                        help="graphs a CPU Session loads (cpu: the CPU variant where the model has one) or the "
                             "portable ones CUDA runs")
    args = parser.parse_args(argv)
    manifest = Manifest.load(args.model)
    weights = SharedWeights(manifest, HostArrays())
    names = args.graphs.split(",")
    print(f"{args.model}: batch {args.batch}, {args.threads} thread(s), {args.runs} runs, positions {args.position}..\n")
    print(wall_table([GraphProbe(manifest, weights, n, args, profile=False) for n in names], args.runs))
    if not args.no_ops:
        print()
        print(op_table([GraphProbe(manifest, weights, n, args, profile=True) for n in names], args.runs, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
