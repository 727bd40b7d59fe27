"""What sampling on the device costs per step on CUDA (python3 tools/gpu.py sample_cost).

Converts the trained model (vocabulary 4,096) and a random model of Qwen3.5's vocabulary
(248,320; MEDIUM's layers, tied embeddings) in float16, then times, per k, batch and sampling
configuration, --steps steps of the greedy graphs (decode, verify_mtp_k{k}) against the sampling
ones (decode_sample, verify_mtp_sample_k{k}), captured and replayed, through the runtime's entry
points (tools/device_sampling_cost.py: the host waits every step, as the plain loop does), rounds
interleaved. The portable graphs sort all V for top-k / top-p (converter/sampling_graph.py); the
table says what that costs beside temperature alone. Prints one table; no check can fail.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from ortspec.manifest import Manifest
from ortspec.runtime.graphs import GraphSet
from tools.device_sampling_cost import Steps
from tools.make_tiny_checkpoint import make_checkpoint

from .common import MEDIUM, TRAINED, convert, markdown_table, write_json

SUMMARY = "sampling on the device against greedy per step on CUDA: decode_sample, verify_mtp_sample_k{k}"
CONFIGS = {"temperature 0.8": dict(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0),
           "temperature 0.8, top-p 0.95": dict(temperature=0.8, top_k=0, top_p=0.95, min_p=0.0)}


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="/tmp/ortspec_sample_cost", help="working directory (converted models)")
    parser.add_argument("--trained", default=str(TRAINED), help="the trained checkpoint")
    parser.add_argument("--batch", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("-k", default="0,3", help="comma-separated k values (0: decode_sample against decode)")
    parser.add_argument("--steps", type=int, default=32, help="timed steps per round and kind")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (plus one to warm up)")


def run(args) -> int:
    out = Path(args.out)
    models = {"trained": convert(args.trained, out / "trained_fp16", dtype="float16"),
              "random V=248320": convert(wide_checkpoint(out / "wide_ck"), out / "wide_fp16", dtype="float16")}
    rows, results = [], []
    for label, model in models.items():
        graphs = GraphSet(Manifest.load(model), provider="cuda")
        for k in (int(x) for x in args.k.split(",")):
            for batch in (int(b) for b in args.batch.split(",")):
                timer = Steps(graphs, batch, k, {}, np.random.default_rng(0), clock=time.perf_counter)
                for name, params in CONFIGS.items():
                    timer.params = params
                    greedy, sampled = step_ms(timer, args.steps, args.rounds)
                    results.append(dict(model=label, k=k, batch=batch, config=name, greedy_ms=greedy,
                                        sampled_ms=sampled))
                    rows.append([label, k, batch, name, f"{greedy:.3f}", f"{sampled:.3f}", f"{greedy / sampled:.2f}"])
                    print(rows[-1], flush=True)
        graphs.close()
    write_json(args.json, {"steps": results})
    print(markdown_table(["model", "k", "batch", "sampling", "greedy ms/step", "sampled ms/step",
                          "greedy / sampled step time"], rows))
    return 0


def wide_checkpoint(out: Path) -> Path:
    """MEDIUM's layers with Qwen3.5's vocabulary (tied embeddings), seed 7."""
    if not (out / "config.json").is_file():
        make_checkpoint(out, seed=7, **dict(MEDIUM, vocab_size=248_320, tie_word_embeddings=True))
    return out


def step_ms(timer: Steps, steps: int, rounds: int) -> tuple[float, float]:
    """(greedy, sampled) median milliseconds per step, rounds interleaved (the first warms up)."""
    times = {False: [], True: []}
    for r in range(rounds + 1):
        for sampled in ((False, True) if r % 2 else (True, False)):
            seconds = timer.run(sampled, steps)
            if r:
                times[sampled].append(seconds)
    return tuple(1e3 * statistics.median(times[s]) for s in (False, True))
