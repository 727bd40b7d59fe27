"""Where the server's tokens go: the same requests through each layer of `ortspec serve`, one run.

    python3 tools/serve_layers.py MODEL_DIR [--provider cuda] [-k 0] [--clients 1,16] [--requests 4]
        [--max-tokens 128] [--rounds 3] [--latency 40] [--threads N] [--temperature T --top-p P] [--json F]

Throughput (per client count C): C clients each send --requests requests one after another,
every request its own prompt and --max-tokens tokens (ignore_eos), through

    generate         Session.generate, batches of C (the reference: 1.00)
    batcher          a Batcher of C rows, a row refilled as soon as its request ends
    engine thread    serve.engine.Engine (the server's loop) with jobs submitted in-process
    engine process   serve.engine_process.EngineProcess: the same loop in a child process, over
                     the pipe the server uses

so a loss between two rows is that layer's. --temperature > 0 makes every request sampled (top-p
--top-p, each request seeded by its index). The HTTP layer is tools/serve_bench.py's. Each layer
runs one untimed round first (a cold first generate call ran at a third of its speed on the H200).

Latency (--latency N > 0): N requests one at a time, each alone in the engine, of 1 token and of
--max-tokens tokens, through the batcher, the Engine, the EngineProcess and the HTTP server
(`ortspec serve --engine process` and `--engine thread`, streamed and whole): the p50 of each,
so the cost a request pays per layer (the pipe, HTTP) shows beside its prefill.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import ortspec  # noqa: E402
from ortspec.manifest import Manifest  # noqa: E402
from ortspec.prompts import Prompts  # noqa: E402
from ortspec.serve.engine import Engine, Failed, Finished, Job  # noqa: E402
from ortspec.serve.engine_process import EngineProcess  # noqa: E402
from ortspec.speculative.sampling import GREEDY, SamplingParams  # noqa: E402
from tools.batcher_bench import through_batcher, through_generate  # noqa: E402
from tools.serve_load import complete, served  # noqa: E402


def texts(n: int, tag: str) -> list[str]:
    """n distinct short code prompts (no two share one: no forks anywhere)."""
    return [f"# {tag} request {i}\ndef f{i}(x):\n    return" for i in range(n)]


def token_ids(prompts: Prompts, lines: list[str]) -> list[list[int]]:
    return prompts.token_prompts(lines)[0]


def job(prompt: list[int], max_tokens: int, on_event, sampling: SamplingParams = GREEDY) -> Job:
    return Job(prompt=prompt, max_tokens=max_tokens, sampling=sampling, deadline=time.monotonic() + 600,
               deliver=on_event, ignore_eos=True)


def through_engine(engine, prompts: list[list[int]], clients: int, max_tokens: int,
                   sampling: dict | None = None) -> float:
    """tokens/s of an Engine-like object (submit(job)) under `clients` clients in turn (sampling:
    temperature, top_p; request i seeded i)."""
    queues = [list(enumerate(prompts))[c::clients] for c in range(clients)]
    finished, lock = threading.Event(), threading.Lock()
    state = {"tokens": 0, "left": len(prompts)}

    def send(c: int) -> None:
        def on_event(event) -> None:
            if isinstance(event, (Finished, Failed)):
                with lock:
                    state["left"] -= 1
                    if state["left"] == 0:
                        finished.set()
                if queues[c]:
                    send(c)
            else:
                state["tokens"] += len(event.ids)
        index, prompt = queues[c].pop(0)
        params = SamplingParams(**sampling, seed=index) if sampling else GREEDY
        engine.submit(job(prompt, max_tokens, on_event, params))

    start = time.perf_counter()
    for c in range(clients):
        send(c)
    finished.wait()
    return state["tokens"] / (time.perf_counter() - start)


def alone(engine, prompt: list[int], max_tokens: int) -> float:
    """Seconds from submit to the last event of one request."""
    done = threading.Event()
    start = time.perf_counter()
    engine.submit(job(prompt, max_tokens, lambda e: done.set() if isinstance(e, (Finished, Failed)) else None))
    done.wait()
    return time.perf_counter() - start


def p50_ms(seconds: list[float]) -> float:
    return round(1e3 * statistics.median(seconds[len(seconds) // 8:]), 3)  # the first eighth: warm-up


def throughput(args, options: dict, prompts: Prompts) -> dict:
    session = ortspec.Session(args.model, **options)
    on_cuda = session.graphs.arrays.device != "cpu"
    rows: dict[str, dict[str, list[float]]] = {}
    for clients in args.clients:
        n = clients * args.requests
        for r in range(-1, args.rounds):  # round -1 warms every layer up (the first generate call is cold) and is dropped
            ids = token_ids(prompts, texts(n, f"round {r} clients {clients}"))
            row = rows.setdefault(str(clients), {}) if r >= 0 else {}
            row.setdefault("generate", []).append(through_generate(session, ids, clients, args.max_tokens, [],
                                                                   sampling=args.sampling)[0])
            row.setdefault("batcher", []).append(through_batcher(session, ids, clients, args.max_tokens, [],
                                                                 warm_up=on_cuda, sampling=args.sampling)[0])
            engine = Engine(session, clients, 1024)
            engine.start()
            row.setdefault("engine thread", []).append(through_engine(engine, ids, clients, args.max_tokens,
                                                                      args.sampling))
            engine.stop()
    session.close()
    for clients in args.clients:
        engine = EngineProcess(args.model, options, clients, 1024)
        engine.start()
        for r in range(-1, args.rounds):
            ids = token_ids(prompts, texts(clients * args.requests, f"process round {r} clients {clients}"))
            tokens_per_second = through_engine(engine, ids, clients, args.max_tokens, args.sampling)
            if r >= 0:
                rows[str(clients)].setdefault("engine process", []).append(tokens_per_second)
        engine.stop()
    return rows


def latency(args, options: dict, prompts: Prompts) -> dict[str, float]:
    sizes, n = (1, args.max_tokens), args.latency
    ids = token_ids(prompts, texts(n, "latency"))
    out: dict[str, float] = {}
    session = ortspec.Session(args.model, **options)
    with session.batcher(max_batch_size=1) as batcher:
        if session.graphs.arrays.device != "cpu":
            batcher.warm_up()
        for size in sizes:
            seconds = []
            for prompt in ids:
                start = time.perf_counter()
                rid = batcher.add_request(prompt, max_new_tokens=size, stop_tokens=[])
                while batcher.pending:
                    batcher.step()
                batcher.forget(rid)
                seconds.append(time.perf_counter() - start)
            out[f"batcher, {size} tokens"] = p50_ms(seconds)
    for name, engine in (("engine thread", Engine(session, 1, 64)), ("engine process", None)):
        engine = engine or EngineProcess(args.model, options, 1, 64)
        engine.start()
        for size in sizes:
            out[f"{name}, {size} tokens"] = p50_ms([alone(engine, p, size) for p in ids])
        engine.stop()
    session.close()
    for kind in ("process", "thread"):
        with served(args.model, args.k, args.provider, args.threads, 1, kind) as url:
            for size in sizes:
                for stream in (True, False):
                    seconds = []
                    for text in texts(n, f"http {kind}"):
                        answer = complete(url, dict(prompt=text, max_tokens=size, stream=stream, temperature=0,
                                                    ignore_eos=True))
                        if answer.status != 200:
                            raise SystemExit(f"serve_layers: the server answered {answer.status}: {answer.error}")
                        seconds.append(answer.seconds)
                    out[f"http, engine {kind}, {'streamed' if stream else 'whole'}, {size} tokens"] = p50_ms(seconds)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("-k", type=int, default=0, help="num_speculative_tokens")
    parser.add_argument("--clients", default="1,16", help="comma-separated client counts (max batch size = C)")
    parser.add_argument("--requests", type=int, default=4, help="requests per client, one after another")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency", type=int, default=40, help="requests alone per latency row (0: none)")
    parser.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads")
    parser.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled requests (throughput rows)")
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.sampling = dict(temperature=args.temperature, top_p=args.top_p) if args.temperature > 0 else None
    args.clients = [int(c) for c in args.clients.split(",")]
    options = dict(provider=args.provider, num_speculative_tokens=args.k)
    if args.threads:
        options["threads"] = args.threads
    prompts = Prompts(Manifest.load(args.model))
    report = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "throughput": throughput(args, options, prompts)}
    print(f"k={args.k} provider={args.provider}{f', temperature {args.temperature} top-p {args.top_p}' if args.sampling else ''}, {args.requests} requests per client x {args.max_tokens} tokens, "
          f"medians of {args.rounds} rounds")
    print("| clients | layer | tok/s | / generate |\n|---|---|---|---|")
    for clients, row in report["throughput"].items():
        reference = statistics.median(row["generate"])
        for layer, values in row.items():
            m = statistics.median(values)
            print(f"| {clients} | {layer} | {m:.0f} | {m / reference:.2f} |")
    if args.latency:
        report["latency_p50_ms"] = latency(args, options, prompts)
        print("\n| a request alone through | p50 ms |\n|---|---|")
        for name, ms in report["latency_p50_ms"].items():
            print(f"| {name} | {ms:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
