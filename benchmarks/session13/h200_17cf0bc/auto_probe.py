"""Probe: auto k in a batcher of 16 rows fed one request at a time (the 1-client server), CUDA.
Run from the repository root: python3 benchmarks/session13/h200_17cf0bc/auto_probe.py MODEL 2,auto,0
(PROBE_POOL=one / nospin: the sessions' intra-op pools)."""
import json, os, sys, time, collections
sys.path.insert(0, os.getcwd())
import ortspec
from tools.serve_bench import distinct
from ortspec.speculative import decoder as D
from ortspec.runtime import graphs as G
_so = G.SharedWeights.session_options
def so(self, names, threads):
    o = _so(self, names, threads)
    v = os.environ.get("PROBE_POOL")
    if v == "one":
        o.intra_op_num_threads = 1
    elif v == "nospin":
        o.add_session_config_entry(G.NO_SPINNING, "0")
    return o
G.SharedWeights.session_options = so
from ortspec.speculative import head as H
_cud = H.Head.catch_up_deferred
CU = []
def cud(self, drafts):
    self.deferred.arrays.synchronize() if hasattr(self.deferred, "arrays") else None
    t = time.perf_counter(); r = _cud(self, drafts)
    self.deferred.arrays.synchronize() if hasattr(self.deferred, "arrays") else None
    CU.append((drafts, round(1e3 * (time.perf_counter() - t), 2)))
    return r
H.Head.catch_up_deferred = cud
_pf = D.Decoder._prefill
PF = []
def pf(self, requests, copies=None):
    t = time.perf_counter(); r = _pf(self, requests, copies); PF.append((len(requests[0].prompt), round(1e3 * (time.perf_counter() - t), 2))); return r
D.Decoder._prefill = pf
prompts = json.load(open("benchmarks/heldout_prompts.json"))
model = sys.argv[1]
kinds = collections.Counter()
orig = D.Decoder._record
def rec(self, flight, result):
    p = flight.plan
    kinds[(p.kind.__name__, p.k, p.drafts)] += 1
    return orig(self, flight, result)
D.Decoder._record = rec
for k in sys.argv[2].split(","):
    kk = k if k == "auto" else int(k)
    s = ortspec.Session(model, provider="cuda", num_speculative_tokens=kk)
    with s.batcher(max_batch_size=16) as b:
        t = time.perf_counter(); b.warm_up(); print(k, "warm_up", round(time.perf_counter() - t, 2), flush=True)
        for rnd in range(2):
            kinds.clear()
            c0, t0, tok = os.times(), time.perf_counter(), 0
            for i in range(16):
                rid = b.add_request(distinct(prompts, i), max_new_tokens=128)
                while b.pending:
                    b.step()
                tok += len(b.result(rid)); b.forget(rid)
            c1, t1 = os.times(), time.perf_counter()
            print(k, "round", rnd, "tok/s", round(tok / (t1 - t0)), "cpu/wall", round((c1.user + c1.system - c0.user - c0.system) / (t1 - t0), 2), flush=True)
            print("  kinds", dict(kinds.most_common(8)))
            print("  catch-ups (k, ms)", CU[-16:]); print("  prefills (n, ms)", PF[-16:]); CU.clear(); PF.clear()
        import glob
        rows = []
        for t in glob.glob("/proc/self/task/*"):
            try:
                f = open(t + "/stat").read().rsplit(")", 1)[1].split()
                name = open(t + "/comm").read().strip()
                rows.append((int(f[11]) + int(f[12]), name, t.rsplit("/", 1)[1]))
            except OSError:
                pass
        rows.sort(reverse=True)
        print("  threads (ticks, name)", [(a, b) for a, b, _ in rows[:12]], "of", len(rows))
        if k == "auto":
            import cProfile
            pr = cProfile.Profile(); pr.enable()
            for i in range(8):
                rid = b.add_request(distinct(prompts, i), max_new_tokens=128)
                while b.pending:
                    b.step()
                b.forget(rid)
            pr.disable()
            pass
            snap = s.stats["auto_k"]
            print("  windows", json.dumps(snap["windows"]))
            print("  step_ms", snap["step_ms"])
        st = s.stats
        print("  seconds", {a: round(v, 3) for a, v in st.get("seconds", {}).items()})
    s.close()
