"""The server against generate, side by side in one run: what `ortspec serve` delivers of the engine.

    python3 tools/serve_bench.py MODEL_DIR [-k 0,2] [--provider cpu|cuda] [--threads N]
        [--clients 1,8] [--requests 4] [--max-tokens 128] [--prompts FILE.json] [--rounds 2]
        [--stream yes|no] [--engines process,thread] [--temperature T] [--top-p P] [--ignore-eos] [--json F]

Per round, per k and per --engines entry: `ortspec serve --engine E` in a child process (max
batch size = the most clients; E = process: the engine in a grandchild of its own, thread: beside
uvicorn),
loaded by C concurrent clients (threads with their own connections: tools/serve_load.py) that
each send --requests requests one after another; then, in this process, a Session of the same k
runs the same requests as --requests generate calls of batch C. Both use the prompts of --prompts
(a JSON list of texts; default the bench's held-out prompts), each request's under a first line
of its own (no two requests share a prompt: ``distinct``), --max-tokens new tokens and the
model's stop tokens (with --ignore-eos none: every request makes --max-tokens tokens; with them,
on the trained model and the held-out prompts some requests stop at their first token), greedy (or, with --temperature > 0, sampled: a server request seeded with
its index, and generate given the same seed for that request's prompt, one seed per prompt, so
sampled outputs are compared too). Each server run also records the CPU cores its process (uvicorn and
the routes; with --engine thread the engine too) and its children (the engine process) kept
busy, from /proc. Reported per (k, clients): the median tokens/s of each over the
rounds, server / generate, and each k's tokens/s over k = the first one's (speculation against
greedy, through the server and through generate). Both sides warm up at each client count
first (C requests of 8 tokens), as a server does at its start on CUDA (Batcher.warm_up), and odd
rounds run generate's side first. Outputs are compared too: a request's tokens
from the server must equal generate's. Where the server's tokens/s goes, as three ratios of
the server's over generate's (``Steps``, from the decoder's counters: the server's /metrics,
generate's Session.stats): tokens per step (rows filled), steps per second of decoder time
(the step's own cost), and the decoder's share of the wall time (the rest: the engine's turns
and the wait for requests).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import ortspec  # noqa: E402
from tools.serve_load import cpu_seconds, run_clients, served  # noqa: E402

DEFAULT_PROMPTS = ROOT / "benchmarks" / "heldout_prompts.json"


def shown(path: Path) -> str:
    """A path as the JSON records it: from the repository's root when it lies inside."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def distinct(prompts: list[str], i: int) -> str:
    """Request i's prompt: prompt i of the list (in turn) under a first line of its own, so that no
    two requests share a prompt. With repeats, generate's batches would prefill each repeated prompt
    once (forks) where the server, whose requests arrive apart, prefills every one."""
    return f"# request {i}\n{prompts[i % len(prompts)]}"


def requests_of(prompts: list[str], clients: int, per_client: int) -> list[list[str]]:
    """The prompt of each client's requests, in order: request r of client c takes prompt c * R + r."""
    return [[distinct(prompts, c * per_client + r) for r in range(per_client)] for c in range(clients)]


def server_side(url: str, texts: list[list[str]], max_tokens: int, stream: bool,
                sampling: dict | None = None, ignore_eos: bool = False) -> tuple[float, dict]:
    """(tokens/s over the wall time, {prompt: text}) of every client sending its requests in order;
    sampling: temperature and top_p for every request, each seeded with its index; ignore_eos: the
    model's stop tokens end no request."""
    bodies = [[{"prompt": p, "max_tokens": max_tokens, "stream": stream, **({"ignore_eos": True} if ignore_eos else {})}
               for p in mine] for mine in texts]
    for i, body in enumerate(body for mine in bodies for body in mine):
        body.update({**sampling, "seed": i} if sampling else {})
    results, seconds = run_clients(url, bodies, timeout=600.0)
    failed = [r for rs in results for r in rs if r.status != 200 or r.error]
    if failed:
        raise SystemExit(f"serve_bench: {len(failed)} requests failed, e.g. {failed[0].status} {failed[0].error}")
    outputs = {body["prompt"]: r.token_ids for bs, rs in zip(bodies, results) for body, r in zip(bs, rs)}
    return sum(len(r.token_ids) for rs in results for r in rs) / seconds, outputs


def generate_side(session, texts: list[list[str]], max_tokens: int, sampling: dict | None = None,
                  ignore_eos: bool = False) -> tuple[float, dict]:
    """(tokens/s, {prompt: token ids}) of the same requests as generate calls: call r batches request r
    of every client, over the ids the server's tokenizer makes of each prompt (sampled: each prompt
    seeded as server_side seeds its request, client c's request r with c * R + r)."""
    calls = [[mine[r] for mine in texts] for r in range(len(texts[0]))]
    ids = {p: session.tokenizer.encode(p).ids for call in calls for p in call}
    tokens, outputs, start = 0, {}, time.perf_counter()
    for r, prompts in enumerate(calls):
        options = {**sampling, "seed": [c * len(calls) + r for c in range(len(prompts))]} if sampling else {}
        for prompt, out in zip(prompts, session.generate([ids[p] for p in prompts], max_new_tokens=max_tokens,
                                                         stop_tokens=[] if ignore_eos else None, **options)):
            outputs[prompt] = out
            tokens += len(out)
    return tokens / (time.perf_counter() - start), outputs


def measure(args, k: int | str, prompts: list[str], clients: list[int], generate_first: bool = False) -> dict:
    """One round for one k: {(engine, clients): (server tok/s, generate tok/s, outputs equal, CPU
    cores busy: server process, its children, Steps of each, generate's mean tokens per request)};
    generate_first: generate's side runs first (rounds alternate the order, so a machine that speeds
    up or slows down favours neither side)."""
    if generate_first:
        generated = generate_runs(args, k, prompts, clients)
        server = server_runs(args, k, prompts, clients)
    else:
        server = server_runs(args, k, prompts, clients)
        generated = generate_runs(args, k, prompts, clients)
    rows = {}
    for (engine, c), (server_rate, served_outputs, busy, server_steps) in server.items():
        rate, outputs, generate_steps = generated[c]
        rows[(engine, c)] = (server_rate, rate, served_outputs == outputs, *busy,
                             dataclasses.asdict(server_steps), dataclasses.asdict(generate_steps),
                             statistics.mean(map(len, outputs.values())))
    return rows


def server_runs(args, k, prompts: list[str], clients: list[int]) -> dict:
    """{(engine, clients): (tok/s, outputs, CPU cores busy, Steps)} through `ortspec serve --engine E`."""
    runs = {}
    for engine in args.engines.split(","):
        with served(args.model, k, args.provider, args.threads, max(clients), engine) as url:
            server_side(url, requests_of(prompts, 2, 1), 8, args.stream == "yes")  # warm-up: sessions, graphs
            for c in clients:
                server_side(url, requests_of(prompts, c, 1), 8, args.stream == "yes")  # warm-up at this load, as generate's
                counted = server_counters(url)
                before, start = cpu_seconds(url.pid), time.perf_counter()
                rate, outputs = server_side(url, requests_of(prompts, c, args.requests), args.max_tokens,
                                            args.stream == "yes", sampling_of(args), args.ignore_eos)
                after, wall = cpu_seconds(url.pid), time.perf_counter() - start
                steps = Steps.between(counted, server_counters(url), wall)
                runs[(engine, c)] = (rate, outputs, tuple((a - b) / wall for a, b in zip(after, before)), steps)
    return runs


@dataclasses.dataclass
class Steps:
    """What a run's steps did, from the decoder's counters: tokens per step (the prefill's first
    tokens left out), steps per second of the decoder's busy time, and that busy time's share of
    the wall time (the rest: the engine's own turns and the wait for requests). Their product
    over the wall is the step side of tokens/s: server over generate = the product of the ratios."""

    tokens_per_step: float
    steps_per_busy_second: float
    busy_share: float

    @classmethod
    def between(cls, before: dict, after: dict, wall: float) -> "Steps":
        steps, busy = after["steps"] - before["steps"], after["busy"] - before["busy"]
        made = (after["generated"] - before["generated"]) - (after["requests"] - before["requests"])
        return cls(made / max(steps, 1), steps / busy if busy else 0.0, busy / wall)


def server_counters(url: str) -> dict:
    """The server's decoder counters from /metrics, once the engine process's stats caught up
    (it sends them every 0.25 s)."""
    time.sleep(0.6)
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("ortspec_"):
            name, value = line.split("{")[0].split()[0], float(line.split()[-1])
            values[name] = values.get(name, 0.0) + value
    return dict(steps=values["ortspec_steps_total"], busy=values.get("ortspec_engine_seconds_total", 0.0),
                generated=values["ortspec_generated_tokens_total"], requests=values["ortspec_requests_admitted_total"])


def session_counters(session) -> dict:
    """generate's side of server_counters, from the Session's stats."""
    stats = session.stats
    return dict(steps=sum(stats["steps_by_k"]), busy=sum(stats["seconds"].values()),
                generated=stats["generated_tokens"], requests=stats["requests"])


def shares(server: dict, generate: dict) -> str:
    """A round's Steps of the server over generate's, one ratio per field."""
    return ", ".join(f"{name.replace('_', ' ')} {server[name]:.3g} / {generate[name]:.3g}" for name in server)


def sampling_of(args) -> dict | None:
    """The requests' sampling parameters (None: greedy)."""
    return dict(temperature=args.temperature, top_p=args.top_p) if args.temperature > 0 else None


def generate_runs(args, k, prompts: list[str], clients: list[int]) -> dict:
    """{clients: (tok/s, outputs)} of the same requests through generate calls of batch C."""
    session = ortspec.Session(args.model, provider=args.provider, num_speculative_tokens=k, threads=args.threads)
    runs = {}
    for c in clients:
        session.generate(requests_of(prompts, c, 1)[0][:1] * c, max_new_tokens=8,  # warm-up at this batch size,
                         **({**sampling_of(args), "seed": 0} if sampling_of(args) else {}))  # with the runs' graphs
        counted, start = session_counters(session), time.perf_counter()
        runs[c] = generate_side(session, requests_of(prompts, c, args.requests), args.max_tokens, sampling_of(args),
                                args.ignore_eos)
        runs[c] += (Steps.between(counted, session_counters(session), time.perf_counter() - start),)
    session.close()
    return runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("-k", default="0,2", help="comma-separated k or auto (the first is the baseline of the ratios)")
    parser.add_argument("--provider", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--clients", default="1,8")
    parser.add_argument("--requests", type=int, default=4, help="requests per client (generate: calls per batch)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--stream", choices=["yes", "no"], default="yes")
    parser.add_argument("--engines", default="process", help="comma-separated: process (the default of ortspec "
                        "serve), thread")
    parser.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled requests")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--ignore-eos", action="store_true", help="the model's stop tokens end no request: every "
                        "request makes --max-tokens tokens")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    ks = [k if k == "auto" else int(k) for k in args.k.split(",")]
    clients = [int(c) for c in args.clients.split(",")]
    prompts = json.loads(args.prompts.read_text())
    engines = args.engines.split(",")
    runs = {(k, e, c): [] for k in ks for e in engines for c in clients}
    for round_ in range(args.rounds):
        for k in (ks if round_ % 2 == 0 else ks[::-1]):
            for (e, c), row in measure(args, k, prompts, clients, generate_first=round_ % 2 == 1).items():
                runs[(k, e, c)].append(row)
                print(f"round {round_} k={k} engine {e} clients {c}: server {row[0]:.1f} tok/s, generate {row[1]:.1f}, "
                      f"outputs equal {row[2]}, {row[7]:.1f} tokens per request; CPU cores busy: server process {row[3]:.2f}, its children "
                      f"{row[4]:.2f}; server / generate: " + shares(row[5], row[6]), flush=True)
    median = {key: (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows),
                    all(r[2] for r in rows),
                    {name: statistics.median(r[5][name] / r[6][name] if r[6][name] else 0.0 for r in rows)
                     for name in rows[0][5]}) for key, rows in runs.items()}
    print("\n| k | engine | clients | server tok/s | generate tok/s | server / generate | server / server k0 | "
          "generate / generate k0 | outputs equal | server / generate: tokens per step, steps per busy s, busy share |"
          "\n|---|---|---|---|---|---|---|---|---|---|")
    for (k, e, c), (server, generate, equal, parts) in median.items():
        base_server, base_generate = median[(ks[0], e, c)][:2]
        print(f"| {k} | {e} | {c} | {server:.0f} | {generate:.0f} | {server / generate:.2f} | {server / base_server:.2f} | "
              f"{generate / base_generate:.2f} | {equal} | {' / '.join(f'{v:.2f}' for v in parts.values())} |")
    if args.json:
        args.json.write_text(json.dumps({"settings": {**vars(args), "model": str(args.model), "prompts": shown(args.prompts),
                                                      "json": str(args.json)},
                                         "runs": {f"k={k} engine={e} clients={c}": rows
                                                  for (k, e, c), rows in runs.items()}},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
