"""How long a prefill Run holds the host (it returns once enqueued) against the whole prefill.

    python3 benchmarks/session19/prefill_launch.py MODEL [--provider cuda]

For prompt lengths 8..512: the median ms until TargetModel.prefill(read=False) returns (the
host's launches: what a join costs the engine thread) and until its tokens are read (the GPU
done too), over 20 prefills into row 5 of a batcher's engine of 16 rows.
"""
import argparse
import statistics
import time

import numpy as np

import ortspec
from ortspec.runtime.states import Rows

p = argparse.ArgumentParser()
p.add_argument("model"); p.add_argument("--provider", default="cuda"); p.add_argument("--repeats", type=int, default=20)
a = p.parse_args()
with ortspec.Session(a.model, provider=a.provider, num_speculative_tokens=0) as session:
    with session.batcher(max_batch_size=16) as batcher:
        decoder = batcher.decoder
        engine, rows = decoder.engine, Rows([5])
        print("| prompt tokens | Run returns, ms | tokens read, ms |")
        print("|---|---|---|")
        for n in (8, 32, 128, 512):
            ids, positions = np.arange(n, dtype=np.int64)[None] % 1000 + 3, np.arange(n, dtype=np.int64)[None]
            launched, done = [], []
            for r in range(a.repeats + 2):
                t0 = time.perf_counter()
                with engine.step():
                    engine.reset(rows)
                    out = engine.target.prefill(rows, ids, positions, read=False)
                    t1 = time.perf_counter()
                    out.read()
                t2 = time.perf_counter()
                if r >= 2:
                    launched.append((t1 - t0) * 1e3); done.append((t2 - t0) * 1e3)
            print(f"| {n} | {statistics.median(launched):.3f} | {statistics.median(done):.3f} |", flush=True)
