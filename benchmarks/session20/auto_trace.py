"""Where auto k's time goes in a batcher: B rows, 2 x B held-out prompts x 128 tokens (no stop
tokens), a row refilled the moment it is free, after Batcher.warm_up; per k, tokens/s, and each
step's k and rows as the policy recorded them (tokens, seconds, ms per step by (k, rows)), the
switches and the sequence of k.
    python3 benchmarks/session20/auto_trace.py MODEL [--batch 8] [-k auto,0,2] [--threads 1]"""
import argparse
import collections
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import ortspec  # noqa: E402
from ortspec.speculative import k_policy  # noqa: E402
from tools.serve_bench import requests_of  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("model"); p.add_argument("--batch", type=int, default=8); p.add_argument("-k", default="auto,0,2")
p.add_argument("--threads", type=int, default=1); p.add_argument("--requests", type=int, default=2)
a = p.parse_args()
prompts = json.loads((ROOT / "benchmarks" / "heldout_prompts.json").read_text())
texts = [t for c in requests_of(prompts, a.batch, a.requests) for t in c]
log = []
for policy in (k_policy.AutoK, k_policy.FixedK):  # every StepRecord the loop hands its policy
    policy.record = (lambda record: lambda self, step: (log.append(step), record(self, step))[1])(policy.record)
for k in a.k.split(","):
    session = ortspec.Session(a.model, threads=a.threads, num_speculative_tokens=k if k == "auto" else int(k))
    ids = [session.tokenizer.encode(t).ids for t in texts]
    with session.batcher(max_batch_size=a.batch) as batcher:
        batcher.warm_up()
        log.clear()
        start, queue, tokens = time.perf_counter(), list(ids), 0
        while queue or batcher.pending:
            while queue and len(batcher.running) < a.batch:
                batcher.add_requests([dict(prompt=queue.pop(0), max_new_tokens=128, stop_tokens=[])])
            for rid, new in batcher.step().items():
                tokens += len(new)
                if batcher.finish_reason(rid):
                    batcher.forget(rid)
        wall = time.perf_counter() - start
    by = collections.defaultdict(lambda: [0, 0, 0.0])
    for step in log:
        cell = by[(step.k, step.rows)]
        cell[0], cell[1], cell[2] = cell[0] + 1, cell[1] + step.tokens, cell[2] + step.elapsed
    print(f"k={k} batch {a.batch}: {tokens / wall:.0f} tok/s over {wall:.2f} s, {len(log)} steps")
    for (kk, rows), (n, made, seconds) in sorted(by.items()):
        print(f"   k {kk} rows {rows}: {n} steps, {made} tokens, {made / seconds:.0f} tok/s, {seconds / n * 1e3:.2f} ms/step")
    print(f"   switches {sum(x.k != y.k for x, y in zip(log, log[1:]))}: " + "".join(str(s.k) for s in log))
    session.close()
