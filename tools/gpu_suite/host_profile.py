"""Where a step's host time goes: cProfile over running steps (was tools/gpu_host_profile.py).

For each k: a running batch (Session.batcher) is warmed up (CUDA graphs captured), the wall
time of --steps steps is taken, then cProfile records --steps more. Prints the wall time per
step and the functions with the most own time per step (native calls and ONNX Runtime's run
appear as built-ins), so the host overhead that the kernel profile of `gpu.py scale` leaves
unexplained is itemised. Runs on the CPU too (--provider cpu).
"""

from __future__ import annotations

import cProfile
import pstats
import time
from pathlib import Path

import ortspec

from .common import STEP_PROMPT, markdown_table, write_json

SUMMARY = "a step's host time itemised with cProfile (CUDA graphs replayed)"
OWN, CUMULATIVE = 2, 3  # the columns of a pstats entry (primitive calls, calls, own, cumulative) to sort by


def add_arguments(parser) -> None:
    parser.add_argument("model", nargs="?", default="/tmp/trained_fp16", help="converted model directory")
    parser.add_argument("-k", "--k", default="0,3", help="comma-separated k values to profile")
    parser.add_argument("--batch", type=int, default=1, help="requests in the running batch")
    parser.add_argument("--steps", type=int, default=60, help="steps timed, then steps profiled")
    parser.add_argument("--provider", default="cuda", choices=["cuda", "cpu"], help="execution provider")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: ONNX Runtime's)")
    parser.add_argument("--top", type=int, default=22, help="functions listed per k")
    parser.add_argument("--calls", type=int, default=0,
                        help="profile this many whole generate calls of --batch prompts x --new-tokens instead of "
                             "batcher steps (the loops one step ahead of the GPU run there; 'auto' allowed in -k)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per request in a profiled call")


def run(args) -> int:
    results = {}
    for k in (x if x == "auto" else int(x) for x in args.k.split(",")):
        if args.calls:
            wall, rows = profile_calls(args.model, k, args.batch, args.calls, args.new_tokens, args.provider,
                                       args.top, threads=args.threads)
            unit = "call"
        else:
            wall, rows = profile_steps(args.model, k, args.batch, args.steps, args.provider, args.top,
                                       threads=args.threads)
            unit = "step"
        results[f"k={k}"] = {f"wall_us_per_{unit}": 1e6 * wall, "top": rows}
        print(f"\n### k={k}, batch {args.batch}: {1e6 * wall:.0f} us per {unit} unprofiled; own time per {unit} "
              f"under cProfile (top {args.top})\n")
        print(markdown_table(["function", f"calls/{unit}", f"own us/{unit}", f"cumulative us/{unit}"],
                             [[r["function"], f"{r['calls_per_step']:.1f}", f"{r['own_us_per_step']:.0f}",
                               f"{r['cumulative_us_per_step']:.0f}"] for r in rows]))
    write_json(args.json, results)
    return 0


def profile_steps(model: str, k: int, batch: int, steps: int, provider: str = "cuda",
                  top: int = 22, threads: int | None = None) -> tuple[float, list[dict]]:
    """(wall seconds per unprofiled step, the `top` functions by own time per profiled step)."""
    session = ortspec.Session(model, provider=provider, num_speculative_tokens=k, threads=threads)
    batcher = session.batcher(max_batch_size=batch)
    for _ in range(batch):
        batcher.add_request(STEP_PROMPT, max_new_tokens=(k + 1) * (2 * steps + 10))
    for _ in range(5):
        batcher.step()
    start = time.perf_counter()
    for _ in range(steps):
        batcher.step()
    wall = (time.perf_counter() - start) / steps
    return wall, profiled(batcher.step, steps, top, OWN)


def profile_calls(model: str, k, batch: int, calls: int, new_tokens: int, provider: str = "cuda", top: int = 22,
                  threads: int | None = None) -> tuple[float, list[dict]]:
    """(wall seconds per unprofiled generate call, the `top` functions by cumulative time per
    profiled call): whole calls, so a loop's per-call costs (prefill, fills and drains, changes of k)
    show beside its per-step ones. Three untimed calls first (graphs captured; auto k's chooser
    has timed every k)."""
    session = ortspec.Session(model, provider=provider, num_speculative_tokens=k, threads=threads)
    prompts = [STEP_PROMPT[j % len(STEP_PROMPT):] + STEP_PROMPT[: j % len(STEP_PROMPT)] for j in range(batch)]
    for _ in range(3):
        session.generate(prompts, max_new_tokens=new_tokens)
    start = time.perf_counter()
    for _ in range(calls):
        session.generate(prompts, max_new_tokens=new_tokens)
    wall = (time.perf_counter() - start) / calls
    rows = profiled(lambda: session.generate(prompts, max_new_tokens=new_tokens), calls, top, CUMULATIVE)
    session.close()
    return wall, rows


def profiled(unit, units: int, top: int, by: int) -> list[dict]:
    """cProfile over `units` calls of unit(): the `top` functions by column `by`, per unit (a step
    or a call; the keys say "per_step" for both, as the JSON always has)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(units):
        unit()
    profiler.disable()
    stats = sorted(pstats.Stats(profiler).stats.items(), key=lambda kv: kv[1][by], reverse=True)[:top]
    return [{"function": f"{name} ({Path(path).name}:{line})" if path != "~" else f"{name} (built-in)",
             "calls_per_step": calls / units, "own_us_per_step": 1e6 * own / units,
             "cumulative_us_per_step": 1e6 * cumulative / units}
            for (path, line, name), (_, calls, own, cumulative, _) in stats]
