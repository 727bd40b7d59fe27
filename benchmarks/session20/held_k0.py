"""What auto k's k = 0 costs against greedy in a batcher: a greedy Session and an auto Session held
at k = 0 (a KScript of [0]), B rows, 3 x B held-out prompts x 128 tokens (no stop tokens), a row
refilled the moment it is free (joins during the plain stretch), after Batcher.warm_up; rounds
alternate the two. Prints tokens/s and the milliseconds inside step() per step.
    python3 benchmarks/session20/held_k0.py MODEL [--batch 8] [--rounds 2] [--threads 1]"""
import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import ortspec  # noqa: E402
from ortspec.speculative.k_policy import KScript  # noqa: E402
from tools.serve_bench import requests_of  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("model"); p.add_argument("--batch", type=int, default=8); p.add_argument("--rounds", type=int, default=2)
p.add_argument("--threads", type=int, default=1)
a = p.parse_args()
texts = [t for c in requests_of(json.loads((ROOT / "benchmarks" / "heldout_prompts.json").read_text()), a.batch, 3)
         for t in c]


def run(k, script):
    session = ortspec.Session(a.model, threads=a.threads, num_speculative_tokens=k)
    ids = [session.tokenizer.encode(t).ids for t in texts]
    with session.batcher(max_batch_size=a.batch) as batcher:
        batcher.warm_up()
        with batcher.decoder.scripted_k(KScript(script)) if script else contextlib.nullcontext():
            start, queue, tokens, inside = time.perf_counter(), list(ids), 0, 0.0
            while queue or batcher.pending:
                while queue and len(batcher.running) < a.batch:
                    batcher.add_requests([dict(prompt=queue.pop(0), max_new_tokens=128, stop_tokens=[])])
                began = time.perf_counter()
                for rid, new in batcher.step().items():
                    tokens += len(new)
                    if batcher.finish_reason(rid):
                        batcher.forget(rid)
                inside += time.perf_counter() - began
            wall = time.perf_counter() - start
    steps = sum(session.stats["steps_by_k"])
    session.close()
    return tokens / wall, inside / max(1, steps) * 1e3


for r in range(a.rounds):
    for name, k, script in (("greedy Session", 0, None), ("auto Session held at k = 0", "auto", [0])):
        rate, ms = run(k, script)
        print(f"round {r} {name}: {rate:.0f} tok/s, {ms:.2f} ms inside step() per step", flush=True)
