"""Probe: CUDA sessions' intra-op pools (ONNX Runtime's default vs one thread), interleaved in one
process; a batcher of 16 rows fed by C clients (1: one request at a time; 16: refilled), greedy.
Run from the repository root: python3 benchmarks/session13/h200_b52ad72/pool_ab.py MODEL 0,3,auto 1,16 3"""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import ortspec
from ortspec.runtime import graphs as G
from tools.serve_bench import distinct
_so = G.SharedWeights.session_options
def so(self, names, threads):
    o = _so(self, names, threads)
    o.intra_op_num_threads = 1 if os.environ.get("PROBE_POOL") == "one" else 0  # 0: ONNX Runtime's default
    return o
G.SharedWeights.session_options = so
prompts = json.load(open("benchmarks/heldout_prompts.json"))
model, ks, clients, rounds = sys.argv[1], sys.argv[2].split(","), [int(c) for c in sys.argv[3].split(",")], int(sys.argv[4])
arms = {}
for pool in ("default", "one"):
    os.environ["PROBE_POOL"] = pool
    for k in ks:
        s = ortspec.Session(model, provider="cuda", num_speculative_tokens=k if k == "auto" else int(k))
        b = s.batcher(max_batch_size=16)
        t = time.perf_counter(); b.warm_up(); w = time.perf_counter() - t
        arms[(pool, k)] = (s, b)
        print(pool, k, "warm_up s", round(w, 2), flush=True)
def run(b, c, n=32, base=0):
    queue = [distinct(prompts, base + i) for i in range(n)]
    ids, t0, c0 = [], time.perf_counter(), os.times()
    while queue or b.pending:
        while queue and len(b.running) < c:
            ids.append(b.add_request(queue.pop(0), max_new_tokens=128))
        b.step()
    wall = time.perf_counter() - t0; c1 = os.times()
    tok = sum(len(b.result(i)) for i in ids)
    for i in ids: b.forget(i)
    return tok / wall, (c1.user + c1.system - c0.user - c0.system) / wall
res = {}
for r in range(rounds):
    order = list(arms) if r % 2 == 0 else list(arms)[::-1]
    for key in order:
        for c in clients:
            tps, cpu = run(arms[key][1], c, base=100 * r)
            res.setdefault((key, c), []).append((round(tps), round(cpu, 2)))
    print("round", r, "done", flush=True)
import statistics
print("| pool | k | clients | tok/s per round | median | cpu/wall |")
for (key, c), v in sorted(res.items(), key=lambda x: (x[0][0][1], x[0][1], x[0][0][0])):
    print(f"| {key[0]} | {key[1]} | {c} | {[a for a, _ in v]} | {statistics.median(a for a, _ in v):.0f} | {statistics.median(b for _, b in v)} |")
for key, (s, b) in arms.items():
    if key[1] == "auto":
        print(key, json.dumps(s.stats["auto_k"]["windows"]))
