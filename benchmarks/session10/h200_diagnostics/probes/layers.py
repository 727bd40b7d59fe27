"""Tokens/s of the same requests through: generate (batches of C), the batcher (rows refilled),
the Engine thread (no HTTP), the EngineProcess (no HTTP). C clients each sending R requests in turn."""
import sys, time, threading, argparse
sys.path.insert(0, ".")
import ortspec
from ortspec.serve.engine import Engine, Job, Finished, Failed
from ortspec.serve.engine_process import EngineProcess
from ortspec.speculative.sampling import GREEDY

def drive(eng, prompts, clients, mt):
    """C clients, each submitting its next request when its last finishes."""
    queues = [prompts[c::clients] for c in range(clients)]
    done = threading.Event(); state = {"tokens": 0, "left": len(prompts)}
    lock = threading.Lock()
    def submit(c):
        p = queues[c].pop(0)
        job = Job(prompt=p, max_tokens=mt, sampling=GREEDY, deadline=time.monotonic() + 600, deliver=None, ignore_eos=True)
        def deliver(ev, c=c):
            if isinstance(ev, (Finished, Failed)):
                with lock:
                    state["left"] -= 1
                    if state["left"] == 0: done.set()
                if queues[c]: submit(c)
            else:
                state["tokens"] += len(ev.ids)
        job.deliver = deliver
        eng.submit(job)
    t = time.perf_counter()
    for c in range(clients): submit(c)
    done.wait()
    return state["tokens"] / (time.perf_counter() - t)

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model"); ap.add_argument("--provider", default="cpu"); ap.add_argument("-k", type=int, default=0)
    ap.add_argument("--clients", type=int, default=1); ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128); ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    opts = dict(provider=a.provider, num_speculative_tokens=a.k)
    if a.threads: opts["threads"] = a.threads
    s = ortspec.Session(a.model, **opts)
    n = a.clients * a.requests
    res = {}
    for r in range(a.rounds):
        prompts = [s.tokenizer.encode(f"# round {r} request {i}\ndef f{i}(x):\n    return").ids for i in range(n)]
        t = time.perf_counter(); tok = 0
        for b in range(a.requests):
            out = s.generate([prompts[c * a.requests + b] for c in range(a.clients)], max_new_tokens=a.max_tokens, stop_tokens=[])
            tok += sum(map(len, out))
        res.setdefault("generate", []).append(tok / (time.perf_counter() - t))
        with s.batcher(max_batch_size=a.clients) as bt:
            if a.provider == "cuda": bt.warm_up()
            q = [list(prompts[c::a.clients]) for c in range(a.clients)]
            owner = {}; tok = 0; t = time.perf_counter()
            for c in range(a.clients):
                owner[bt.add_request(q[c].pop(0), max_new_tokens=a.max_tokens, stop_tokens=[])] = c
            while bt.pending:
                for rid, toks in bt.step().items(): tok += len(toks)
                for rid in [x for x in owner if x not in bt.pending]:
                    c = owner.pop(rid); bt.forget(rid)
                    if q[c]: owner[bt.add_request(q[c].pop(0), max_new_tokens=a.max_tokens, stop_tokens=[])] = c
            res.setdefault("batcher", []).append(tok / (time.perf_counter() - t))
        eng = Engine(s, a.clients, 1024); eng.start()
        res.setdefault("engine thread", []).append(drive(eng, list(prompts), a.clients, a.max_tokens)); eng.stop()
    s.close()
    ep = EngineProcess(a.model, opts, a.clients, 1024); ep.start()
    for r in range(a.rounds):
        prompts = [ortspec.Session.__module__ and None]
    tok_prompts = []
    from ortspec.prompts import Prompts
    for r in range(a.rounds):
        ps = [ep_tok(a.model, f"# round {r} request {i}\ndef f{i}(x):\n    return") for i in range(n)]
        res.setdefault("engine process", []).append(drive(ep, ps, a.clients, a.max_tokens))
    ep.stop()
    g = sorted(res["generate"])[len(res["generate"]) // 2]
    print(f"k={a.k} clients={a.clients} provider={a.provider}")
    for name, v in res.items():
        m = sorted(v)[len(v) // 2]
        print(f"  {name:16s} {m:9.0f} tok/s  {m / g:5.2f}x generate   rounds {[round(x) for x in v]}")

_tok = {}
def ep_tok(model, text):
    if "t" not in _tok:
        from tokenizers import Tokenizer
        import pathlib
        _tok["t"] = Tokenizer.from_file(str(pathlib.Path(model) / "tokenizer.json"))
    return _tok["t"].encode(text).ids

if __name__ == "__main__":
    main()
