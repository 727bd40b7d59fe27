"""Per-request latency of 1-token requests, one at a time, at each layer: batcher, Engine thread,
EngineProcess (no HTTP), the HTTP server (process and thread engines), stream and not."""
import sys, time, statistics, threading
sys.path.insert(0, "."); sys.path.insert(0, "..")
import ortspec
from ortspec.serve.engine import Engine, Job, Finished, Failed
from ortspec.serve.engine_process import EngineProcess
from ortspec.speculative.sampling import GREEDY
from tools.serve_load import served, complete
from layers import ep_tok

def one(eng, prompt, mt):
    done = threading.Event()
    job = Job(prompt=prompt, max_tokens=mt, sampling=GREEDY, deadline=time.monotonic() + 60, deliver=None, ignore_eos=True)
    job.deliver = lambda ev: done.set() if isinstance(ev, (Finished, Failed)) else None
    t = time.perf_counter(); eng.submit(job); done.wait(); return time.perf_counter() - t

def main():
    model, provider = sys.argv[1], sys.argv[2]
    mts = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [1, 32]
    opts = dict(provider=provider, num_speculative_tokens=0)
    text = lambda i: f"# request {i}\ndef f{i}(x):\n    return"
    prompts = [ep_tok(model, text(i)) for i in range(40)]
    res = {}
    s = ortspec.Session(model, **opts)
    with s.batcher(max_batch_size=1) as b:
        if provider == "cuda": b.warm_up()
        for mt in mts:
            lat = []
            for p in prompts:
                t = time.perf_counter(); rid = b.add_request(p, max_new_tokens=mt, stop_tokens=[])
                while b.pending: b.step()
                b.forget(rid); lat.append(time.perf_counter() - t)
            res[("batcher", mt)] = lat[5:]
    eng = Engine(s, 1, 64); eng.start()
    for mt in mts: res[("engine thread", mt)] = [one(eng, p, mt) for p in prompts][5:]
    eng.stop(); s.close()
    ep = EngineProcess(model, opts, 1, 64); ep.start()
    for mt in mts: res[("engine process", mt)] = [one(ep, p, mt) for p in prompts][5:]
    ep.stop()
    for engine in ("process", "thread"):
        with served(model, 0, provider, None, 1, engine) as url:
            for mt in mts:
                for stream in (True, False):
                    lat = []
                    for i in range(40):
                        c = complete(url, dict(prompt=text(i), max_tokens=mt, stream=stream, temperature=0, ignore_eos=True))
                        assert c.status == 200, c.error
                        lat.append(c.seconds)
                    res[(f"http {engine} {'stream' if stream else 'whole'}", mt)] = lat[5:]
    for (name, mt), lat in res.items():
        print(f"{name:22s} max_tokens={mt:4d}: p50 {statistics.median(lat)*1e3:7.2f} ms  mean {statistics.mean(lat)*1e3:7.2f}")

if __name__ == "__main__":
    main()
