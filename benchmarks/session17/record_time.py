"""Milliseconds of Decoder._record per step (a step's host bookkeeping), generate of 16 rows over the tiny model:
    PYTHONPATH=TREE python3 benchmarks/session17/record_time.py MODEL K   (MODEL: ortspec convert models/tiny-qwen35 MODEL -k 4)"""
import time, random, sys
import ortspec
from ortspec.speculative.decoder import Decoder
acc = {"_record": [0.0, 0]}
orig = Decoder._record
def timed(self, *a, **k):
    t = time.perf_counter(); r = orig(self, *a, **k); d = acc["_record"]; d[0] += time.perf_counter() - t; d[1] += 1; return r
Decoder._record = timed
model, k = sys.argv[1], int(sys.argv[2])
s = ortspec.Session(model, threads=1, num_speculative_tokens=k)
random.seed(0)
prompts = [[random.randrange(1, 500) for _ in range(random.randrange(4, 20))] for _ in range(16)]
s.generate(prompts, max_new_tokens=8)
acc["_record"] = [0.0, 0]
t = time.perf_counter()
for _ in range(3):
    s.generate(prompts, max_new_tokens=64, stop_tokens=[])
wall = time.perf_counter() - t
tot, n = acc["_record"]
print(f"k={k} wall {wall:.3f}s, _record {tot*1e3/n:.3f} ms per step over {n} steps = {tot/wall:.1%} of wall")
