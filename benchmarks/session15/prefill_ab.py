"""A prefill's time in two model directories, Runs interleaved (session 15: the prefill's logits of
its last row alone against every row's).

    python3 benchmarks/session15/prefill_ab.py OLD_DIR NEW_DIR PROMPT_TOKENS [THREADS] [ROUNDS]
"""
import sys
import time

import numpy as np

import ortspec
from ortspec.runtime.model import TargetModel
from ortspec.runtime.states import Rows

dirs, n = sys.argv[1:3], int(sys.argv[3])
threads = int(sys.argv[4]) if len(sys.argv) > 4 else 1
rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 12
sessions = [ortspec.Session(d, threads=threads) for d in dirs]
targets = [TargetModel(s.graphs, 1) for s in sessions]
ids = np.random.default_rng(0).integers(0, sessions[0].manifest.spec.vocab_size, (1, n))
positions = np.arange(n)[None]
times = {d: [] for d in dirs}
for r in range(rounds):
    for d, target in zip(dirs, targets):
        target.reset(Rows([0]))
        start = time.perf_counter()
        out = target.prefill(Rows([0]), ids, positions)
        times[d].append(time.perf_counter() - start)
        if r == 0:
            print(d, "logits", out["logits"].shape, "first token", out.tokens[0, -1])
for d in dirs:
    warm = times[d][2:]
    print(f"{d}: prefill of {n} tokens, median {1e3 * np.median(warm):.1f} ms, min {1e3 * min(warm):.1f} ms")
