"""A long run through the batcher: memory, CUDA-graph counters and tokens over 20,000+ steps (python3 tools/gpu.py soak).

Four Sessions of the trained model (k = 1, 2, 3, 4; commit select, or readvance with
--commit), each with a batcher of --max-batch rows (8), stepped in turn in one process. Requests
arrive staggered (a free row is filled with probability 1/2 per step for 500 steps, then 1/30
for 500, and so on, so the occupancy sweeps between 1 and 8), with held-out code prompts
(exact_prompts.token_prompts) and 16..160 new tokens.
Checked:
(1) device memory in use, sampled every --every speculative steps (all Sessions together), is
    flat after the warm-up sample: max - min <= --flat-mib;
(2) every CUDA-graph slot: fallbacks 0 and invalidations 0;
(3) every request's tokens equal its solo run: the request alone in a batcher of the same size on
    the same Session (the same graph shapes as in the soak; --solo N checks a deterministic
    sample of N per Session instead of all, to fit a time budget).
Prompts stay far from max_length, so every step of every request is speculative, alone or not.
Table last; exits 1 if any check fails.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import numpy as np

import ortspec

from .common import TRAINED, Checks, convert, graph_faults, markdown_table, write_json
from .exact_prompts import token_prompts

SUMMARY = "20,000+ speculative steps through batchers, k = 1..4: memory flat, graph faults 0, tokens = solo runs"


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="/tmp/ortspec_gpu_soak", help="working directory (converted model)")
    parser.add_argument("--steps", type=int, default=20000, help="speculative steps in all (summed over Sessions)")
    parser.add_argument("--ks", default="1,2,3,4", help="one Session (and batcher) per k")
    parser.add_argument("--max-batch", type=int, default=8, help="rows of each batcher")
    parser.add_argument("--dtype", default="float16", help="dtype the trained model is converted to")
    parser.add_argument("--commit", default="select", choices=["select", "readvance"], help="every Session's commit")
    parser.add_argument("--every", type=int, default=1000, help="sample device memory every N steps")
    parser.add_argument("--flat-mib", type=float, default=8.0, help="largest allowed memory drift after warm-up")
    parser.add_argument("--solo", type=int, default=None, help="check N requests per Session alone (default: all)")
    parser.add_argument("--provider", default="cuda", choices=["cuda", "cpu"], help="cpu: a small dry run")


def run(args) -> int:
    checks = Checks()
    model = convert(TRAINED, Path(args.out) / args.dtype, dtype=args.dtype, max_length=1024)
    ks = [int(k) for k in args.ks.split(",")]
    sessions = [ortspec.Session(model, provider=args.provider, num_speculative_tokens=k, commit=args.commit)
                for k in ks]
    prompts = token_prompts(sessions[0], count=512, seed=11)
    start = time.perf_counter()
    requests, memory = soak(sessions, prompts, args)
    seconds = time.perf_counter() - start
    steps = [s.stats["speculative_steps"] for s in sessions]
    print(f"soak: {sum(steps)} speculative steps ({dict(zip(ks, steps))}), {sum(map(len, requests))} requests, "
          f"{seconds:.0f} s")
    drift = check_memory(memory, args.flat_mib, checks)
    faults = {s.k: graph_faults(s) for s in sessions}
    checks.record("graph_faults", not any(faults.values()), faults)
    wrong = check_solo(sessions, requests, args, checks)
    checks.results.update(steps=steps, memory_mib=memory, seconds=seconds)
    write_json(args.json, checks.results)
    print(markdown_table(["k", "speculative steps", "requests", "solo checked", "differing", "graph faults"],
                         [[s.k, n, len(r), wrong[s.k][0], wrong[s.k][1], faults[s.k]]
                          for s, n, r in zip(sessions, steps, requests)]))
    print(f"device memory (MiB) every {args.every} steps: {[round(m, 1) for m in memory]}; drift after warm-up "
          f"{drift:.1f} MiB")
    return checks.exit_status()


def soak(sessions, prompts, args) -> tuple[list[list[tuple]], list[float]]:
    """Steps every Session's batcher in turn until args.steps speculative steps ran; returns per
    Session its requests [(prompt, max_new_tokens, tokens)] and the memory samples."""
    rng = np.random.default_rng(5)
    requests = [[] for _ in sessions]
    memory, next_sample = [], 0
    with contextlib.ExitStack() as stack:
        batchers = [stack.enter_context(s.batcher(max_batch_size=args.max_batch)) for s in sessions]
        live = [{} for _ in sessions]  # request id -> (prompt, max_new_tokens)
        loop = 0
        while True:
            done = sum(s.stats["speculative_steps"] for s in sessions)
            if done >= next_sample:
                memory.append(_device_mib(args.provider))
                next_sample += args.every
            if done >= args.steps:
                break
            arrival = 0.5 if (loop // 500) % 2 == 0 else 1 / 30
            loop += 1
            for i, batcher in enumerate(batchers):
                if len(batcher.running) < args.max_batch and rng.random() < arrival:
                    prompt, n = prompts[rng.integers(len(prompts))], int(rng.integers(16, 161))
                    live[i][batcher.add_request(prompt, max_new_tokens=n)] = (prompt, n)
                if batcher.pending:
                    batcher.step()
                for rid in [r for r in live[i] if r not in batcher.pending]:
                    requests[i].append((*live[i].pop(rid), batcher.result(rid)))
        for i, batcher in enumerate(batchers):  # finish what is in flight
            while batcher.pending:
                batcher.step()
            requests[i] += [(*pn, batcher.result(rid)) for rid, pn in live[i].items()]
    return requests, memory


def check_memory(memory: list[float], flat_mib: float, checks: Checks) -> float:
    after_warmup = memory[1:] or memory
    drift = max(after_warmup) - min(after_warmup)
    checks.record("memory_flat", drift <= flat_mib, drift)
    return drift


def check_solo(sessions, requests, args, checks: Checks) -> dict[int, tuple[int, int]]:
    """{k: (requests checked, requests differing from their solo run)}."""
    out = {}
    for session, done in zip(sessions, requests):
        sample = done if args.solo is None else done[:: max(1, len(done) // max(1, args.solo))][: args.solo]
        with session.batcher(max_batch_size=args.max_batch) as alone:
            differing = 0
            for prompt, n, tokens in sample:
                rid = alone.add_request(prompt, max_new_tokens=n)
                while alone.pending:
                    alone.step()
                differing += alone.result(rid) != tokens
        out[session.k] = (len(sample), differing)
        checks.record(f"solo_k{session.k}", differing == 0, out[session.k])
    return out


def _device_mib(provider: str) -> float:
    if provider != "cuda":
        return 0.0
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20
