"""The batcher against generate in one process, no HTTP: what continuous batching costs over
generate before the server adds anything (tools/serve_bench.py measures the server).

    python3 tools/batcher_bench.py MODEL_DIR [--provider cpu|cuda] [--threads N] [-k 0] [--batch 1,16]
        [--requests 4] [--max-tokens 128] [--prompts FILE.json] [--rounds 2] [--profile N] [--timing]
        [--temperature T --top-p P]

Per batch size B: B x --requests held-out prompts, each under a first line of its own
(serve_bench.distinct: no prompt repeats, so generate forks none; the model's stop tokens, greedy) as
--requests generate calls of batch B, then through one batcher of B rows that admits the next
request the moment a row is free; rounds interleave the two. Reported: tokens/s of each,
batcher / generate, the batcher's steps and mean milliseconds per step() call, and whether every
request's tokens equal generate's (sampled, --temperature > 0: generate call i seeded i, its
prompt j drawing stream j, and the batcher's request given that seed and stream, so a sampled
request's tokens must equal generate's too). Then each side's seconds per phase (Stats.seconds) over its
last round; --profile N: the N functions of most cumulative time in one more batcher pass;
--timing: host seconds and calls of the pieces of a join (drain, prefill, its Run, its download,
a run's opening) in one more pass of each side.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import ortspec  # noqa: E402

DEFAULT_PROMPTS = ROOT / "benchmarks" / "heldout_prompts.json"


def through_generate(session, requests: list[list[int]], batch: int, max_tokens: int,
                     stop_tokens=None, sampling: dict | None = None) -> tuple[float, list]:
    """(tokens/s, outputs): the requests as generate calls of `batch` (stop_tokens: generate's;
    sampling: temperature, top_p, call i seeded i)."""
    start, outputs = time.perf_counter(), []
    for i in range(0, len(requests), batch):
        seeded = {**sampling, "seed": i // batch} if sampling else {}
        outputs += session.generate(requests[i:i + batch], max_new_tokens=max_tokens, stop_tokens=stop_tokens,
                                    **seeded)
    return sum(map(len, outputs)) / (time.perf_counter() - start), outputs


def through_batcher(session, requests: list[list[int]], batch: int, max_tokens: int, stop_tokens=None,
                    warm_up: bool = False, sampling: dict | None = None) -> tuple[float, list, int, float]:
    """(tokens/s, outputs in request order, steps, seconds inside step()): one batcher of `batch`
    rows, a row refilled the moment it is free; warm_up: Batcher.warm_up first, as a server does;
    sampling: request i seeded as prompt i % batch of generate call i // batch (through_generate)."""
    with session.batcher(max_batch_size=batch) as batcher:
        if warm_up:
            batcher.warm_up()
        queue, ids, steps, stepping = list(enumerate(requests)), {}, 0, 0.0
        start = time.perf_counter()
        while queue or batcher.pending:
            while queue and len(batcher.running) < batch:
                index, prompt = queue.pop(0)
                seeded = {**sampling, "seed": index // batch, "seed_index": index % batch} if sampling else {}
                ids[index] = batcher.add_request(prompt, max_new_tokens=max_tokens, stop_tokens=stop_tokens,
                                                 **seeded)
            began = time.perf_counter()
            batcher.step()
            stepping += time.perf_counter() - began
            steps += 1
        seconds = time.perf_counter() - start
        outputs = [batcher.result(ids[i]) for i in range(len(requests))]
    return sum(map(len, outputs)) / seconds, outputs, steps, stepping


TIMED = [("ortspec.speculative.decoder", "Decoder", ["admit", "drain", "_prefill_forward", "_prefill_finish", "_close_run", "step"]),
         ("ortspec.runtime.model", "TargetModel", ["reset", "prefill", "_run"]),
         ("ortspec.runtime.graphs", "GraphRunner", ["run_bound", "run"]),
         ("ortspec.runtime.graphs", "GraphSet", ["begin_step"]),
         ("ortspec.runtime.states", "StateSet", ["advance", "feeds"]),
         ("ortspec.speculative.step_kinds", "StepKinds", ["open"]),
         ("ortspec.speculative.sampler", None, ["pick"]),
         ("ortspec.runtime.model", None, ["_forward"])]


class Timing:
    """Host seconds and calls per wrapped function, while active (``TIMED``)."""

    def __init__(self) -> None:
        import importlib

        self.seconds, self.calls, self._undo = {}, {}, []
        for module_name, class_name, names in TIMED:
            module = importlib.import_module(module_name)
            owner = getattr(module, class_name) if class_name else module
            for name in names:
                self._wrap(owner, name, f"{class_name or module_name.rsplit('.', 1)[1]}.{name}")

    def _wrap(self, owner, name: str, label: str) -> None:
        original = owner.__dict__[name]

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start
                self.calls[label] = self.calls.get(label, 0) + 1

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def close(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)

    def lines(self) -> list[str]:
        return [f"    {label}: {self.seconds[label]:.4f} s / {self.calls[label]} calls = "
                f"{1e3 * self.seconds[label] / self.calls[label]:.3f} ms" for label in sorted(self.seconds)]


def timed_pass(run) -> list[str]:
    timing = Timing()
    try:
        run()
    finally:
        timing.close()
    return timing.lines()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--provider", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("-k", default="0")
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--requests", type=int, default=4, help="requests per row (generate: calls per batch size)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", type=int, default=0, help="print the N functions of most cumulative time")
    parser.add_argument("--timing", action="store_true", help="host time of a join's pieces, per side")
    parser.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled requests, seeded")
    parser.add_argument("--top-p", type=float, default=1.0)
    args = parser.parse_args(argv)
    sampling = dict(temperature=args.temperature, top_p=args.top_p) if args.temperature > 0 else None
    k = args.k if args.k == "auto" else int(args.k)
    session = ortspec.Session(args.model, provider=args.provider, num_speculative_tokens=k, threads=args.threads)
    texts = json.loads(args.prompts.read_text())
    from tools.serve_bench import distinct

    count = max(int(b) for b in args.batch.split(",")) * args.requests
    prompts = [session.tokenizer.encode(distinct(texts, i)).ids for i in range(count)]
    print("| batch | generate tok/s | batcher tok/s | batcher / generate | steps | ms per step() | same tokens |\n"
          "|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batch.split(",")):
        requests = [prompts[i % len(prompts)] for i in range(batch * args.requests)]
        through_generate(session, requests[:batch], batch, 8, sampling=sampling)  # warm-up at this batch size (graphs)
        through_batcher(session, requests[:batch], batch, 8, sampling=sampling)
        rates, phases = {"generate": [], "batcher": []}, {}
        for _ in range(args.rounds):
            session.reset_stats()
            generated, want = through_generate(session, requests, batch, args.max_tokens, sampling=sampling)
            phases["generate"] = session.stats["seconds"]
            session.reset_stats()
            batched, got, steps, stepping = through_batcher(session, requests, batch, args.max_tokens, sampling=sampling)
            phases["batcher"] = session.stats["seconds"]
            rates["generate"].append(generated)
            rates["batcher"].append(batched)
        g, b = statistics.median(rates["generate"]), statistics.median(rates["batcher"])
        print(f"| {batch} | {g:.0f} | {b:.0f} | {b / g:.2f} | {steps} | {1e3 * stepping / steps:.3f} | {got == want} |",
              flush=True)
        for side, seconds in phases.items():
            print(f"  {side} phases: " + ", ".join(f"{name} {value:.3f} s" for name, value in seconds.items()), flush=True)
        if args.timing:
            for side, run in [("generate", lambda: through_generate(session, requests, batch, args.max_tokens,
                                                                    sampling=sampling)),
                              ("batcher", lambda: through_batcher(session, requests, batch, args.max_tokens,
                                                                  sampling=sampling))]:
                print(f"  {side} timing:", *timed_pass(run), sep="\n", flush=True)
        if args.profile:
            profile = cProfile.Profile()
            profile.runcall(through_batcher, session, requests, batch, args.max_tokens, sampling=sampling)
            pstats.Stats(profile).sort_stats("cumulative").print_stats(args.profile)
    session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
