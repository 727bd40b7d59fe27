"""Steady-state generate tokens/s of the ortspec on PYTHONPATH (16 rows, host-bound):
    PYTHONPATH=TREE python3 benchmarks/session17/generate_rate.py MODEL K TEMPERATURE   (MODEL: the tiny model converted)"""
import time, random, sys
import ortspec
model, k, temp = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = ortspec.Session(model, threads=1, num_speculative_tokens=k)
random.seed(0)
prompts = [[random.randrange(1, 500) for _ in range(random.randrange(4, 20))] for _ in range(16)]
opts = dict(temperature=temp, seed=3) if temp else {}
s.generate(prompts, max_new_tokens=8, **opts)
best = 1e9
for _ in range(5):
    t = time.perf_counter(); out = s.generate(prompts, max_new_tokens=64, stop_tokens=[], **opts); best = min(best, time.perf_counter() - t)
print(sum(map(len, out)) / best)
