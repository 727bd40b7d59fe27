"""Interleaved A/B of two ortspec trees on the CPU: generate tokens/s and each step's host time.

    python3 benchmarks/session19/host_ab.py MODEL BASE_TREE NEW_TREE [--rounds 6] [--configs 0x1,2x1,0x4,2x4]
                                            [--prompts 8] [--tokens 128] [--cpu 1]

MODEL: a converted model (``ortspec convert models/qwen35-python-20m MODEL``). Each round runs
every config (k x batch) once per tree, in a fresh process pinned to one core (taskset) with one
ONNX Runtime thread, the trees' order alternating by round, so drift and neighbours' load fall on
both alike. A run: --prompts prompts of 4..19 token ids (seed 0), in generate calls of batch rows
each, --tokens new tokens each, no stop tokens, after one warm-up call. Per step it times
``Decoder.step`` and the ONNX Runtime Runs inside it (``run_with_iobinding``); host = step - Runs
(feeds, commits, bookkeeping, and the Python around the Run calls). Printed: each run, then per
config the median of the rounds' new/base ratios with their range (tokens per wall second, per
CPU second of the process, the Runs' ms and the host's ms per step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def child(model: str, k: int, batch: int, prompts: int, tokens: int) -> dict:
    """One run in this process (the tree on PYTHONPATH): tokens per wall and per CPU second, median
    step / host / Run ms."""
    import random

    import onnxruntime as ort

    in_runs = [0.0]

    class TimedSession:  # times every Run over IOBinding of the sessions made from here on
        def __init__(self, sess) -> None:
            self._sess = sess

        def __getattr__(self, name):
            return getattr(self._sess, name)

        def run_with_iobinding(self, *args):
            start = time.perf_counter()
            try:
                return self._sess.run_with_iobinding(*args)
            finally:
                in_runs[0] += time.perf_counter() - start

    create = ort.InferenceSession._create_inference_session

    def timed_create(self, *args, **kwargs):
        create(self, *args, **kwargs)
        self._sess = TimedSession(self._sess)

    ort.InferenceSession._create_inference_session = timed_create
    import ortspec
    from ortspec.speculative.decoder import Decoder

    steps, step = [], Decoder.step

    def timed_step(decoder):
        runs, start = in_runs[0], time.perf_counter()
        stepped = step(decoder)
        if stepped:
            steps.append((time.perf_counter() - start, in_runs[0] - runs))
        return stepped

    Decoder.step = timed_step
    session = ortspec.Session(model, num_speculative_tokens=k, threads=1)
    rng = random.Random(0)
    ids = [[rng.randrange(1, 500) for _ in range(rng.randrange(4, 20))] for _ in range(prompts)]
    calls = [ids[i: i + batch] for i in range(0, prompts, batch)]
    session.generate(calls[0], max_new_tokens=16, stop_tokens=[])
    steps.clear()
    start, cpu, generated = time.perf_counter(), time.process_time(), 0
    for call in calls:
        generated += sum(map(len, session.generate(call, max_new_tokens=tokens, stop_tokens=[])))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"tok_s": generated / wall, "tok_cpu_s": generated / cpu, "steps": len(steps),
            "step_ms": 1e3 * statistics.median(s for s, _ in steps),
            "run_ms": 1e3 * statistics.median(r for _, r in steps),
            "host_ms": 1e3 * statistics.median(s - r for s, r in steps)}


def run(tree: str, args, k: int, batch: int) -> dict:
    command = ["taskset", "-c", args.cpu, sys.executable, os.path.abspath(__file__), "--child", args.model,
               str(k), str(batch), str(args.prompts), str(args.tokens)]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--child"]:
        model, k, batch, prompts, tokens = sys.argv[2], *map(int, sys.argv[3:7])
        print(json.dumps(child(model, k, batch, prompts, tokens)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("base")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--configs", default="0x1,2x1,0x4,2x4", help="k x batch, comma-separated")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--cpu", default="1", help="the core (taskset -c)")
    args = parser.parse_args(argv)
    configs = [tuple(map(int, c.split("x"))) for c in args.configs.split(",")]
    results: dict = {(c, side): [] for c in configs for side in ("base", "new")}
    print("round config tree tok/s tok/cpu-s step_ms run_ms host_ms", flush=True)
    for r in range(args.rounds):
        for k, batch in configs:
            order = [("base", args.base), ("new", args.new)][:: 1 if r % 2 == 0 else -1]
            for side, tree in order:
                out = run(tree, args, k, batch)
                results[((k, batch), side)].append(out)
                print(f"{r} k={k},b={batch} {side} {out['tok_s']:.1f} {out['tok_cpu_s']:.1f} {out['step_ms']:.3f} "
                      f"{out['run_ms']:.3f} {out['host_ms']:.3f}", flush=True)
    print("\nconfig: new/base per round, median [min..max]  (tok/s, tokens per CPU second, Run ms, host ms)")
    for c in configs:
        base, new = results[(c, "base")], results[(c, "new")]
        for field in ("tok_s", "tok_cpu_s", "run_ms", "host_ms"):
            ratios = sorted(n[field] / b[field] for n, b in zip(new, base))
            medians = statistics.median(b[field] for b in base), statistics.median(n[field] for n in new)
            print(f"k={c[0]},b={c[1]} {field}: base {medians[0]:.3f} new {medians[1]:.3f}  ratio "
                  f"{statistics.median(ratios):.3f} [{ratios[0]:.3f}..{ratios[-1]:.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
