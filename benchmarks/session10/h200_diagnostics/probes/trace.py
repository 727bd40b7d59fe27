"""Where a 1-token request's time goes through the EngineProcess: timestamps across both processes."""
import sys, os, time, threading, statistics
sys.path.insert(0, "."); sys.path.insert(0, "..")
from ortspec.serve import engine_process as ep_mod
from ortspec.serve.engine import Job, Finished, Failed
from ortspec.speculative.sampling import GREEDY
from layers import ep_tok

def traced_child(*args, **kwargs):
    import time as _t
    from ortspec.serve import engine_process as m, engine as e
    from ortspec.speculative import batcher as b
    marks = {}
    orig_recv = None
    def wrap(obj, name, label, when="before"):
        f = getattr(obj, name)
        def g(*a, **k):
            if when == "before": marks.setdefault(label, []).append(_t.perf_counter())
            r = f(*a, **k)
            if when == "after": marks.setdefault(label, []).append(_t.perf_counter())
            return r
        setattr(obj, name, g)
    wrap(e.Engine, "submit", "c1 child submit")
    wrap(b.Batcher, "add_requests", "c2 admit start")
    wrap(b.Batcher, "add_requests", "c3 admit end", "after")
    wrap(m.Outbox, "flush", "c4 flush")
    import multiprocessing.connection as mc
    f = mc.Connection.send
    def send(self, obj):
        if isinstance(obj, dict) and obj.get("events"):
            marks.setdefault("c5 sender send", []).append(_t.perf_counter())
            obj = dict(obj, marks={k: v[-1] for k, v in marks.items()})
        return f(self, obj)
    mc.Connection.send = send
    import os
    spin = float(os.environ.get("PROBE_SPIN_MS", "0")) / 1e3
    if spin:
        orig_turn = e.Engine._turn
        def _turn(self):
            until = _t.perf_counter() + spin
            while not (self._stopping or self._queue or self._running or self._cancels) and _t.perf_counter() < until:
                _t.sleep(0)
            return orig_turn(self)
        e.Engine._turn = _turn
    return m.child_main(*args, **kwargs)

def main():
    model, provider = sys.argv[1], sys.argv[2]
    ep_mod.child_main = traced_child
    ep = ep_mod.EngineProcess(model, dict(provider=provider, num_speculative_tokens=0), 1, 64); ep.start()
    got = {}
    orig_take = ep._take
    def take(message):
        got["p6 parent recv"] = time.perf_counter()
        if "marks" in message: got.update(message["marks"])
        return orig_take(message)
    ep._take = take
    rows = []
    for i in range(40):
        done = threading.Event()
        job = Job(prompt=ep_tok(model, f"# request {i}\ndef f{i}(x):\n    return"), max_tokens=1, sampling=GREEDY,
                  deadline=time.monotonic() + 60, deliver=None, ignore_eos=True)
        def deliver(ev):
            if isinstance(ev, (Finished, Failed)):
                got["p7 delivered"] = time.perf_counter(); done.set()
        job.deliver = deliver
        got.clear()
        t0 = time.perf_counter(); ep.submit(job); done.wait()
        rows.append({k: (v - t0) * 1e3 for k, v in got.items() if isinstance(v, float)})
        time.sleep(float(os.environ.get('PROBE_GAP_MS', '5')) / 1e3)
    ep.stop()
    keys = sorted({k for r in rows[5:] for k in r})
    for k in keys:
        vals = [r[k] for r in rows[5:] if k in r]
        print(f"{k:20s} p50 {statistics.median(vals):7.3f} ms after submit")

if __name__ == "__main__":
    main()
