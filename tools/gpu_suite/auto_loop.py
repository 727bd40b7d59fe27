"""Auto k in the loop at depth 1 on CUDA (python3 tools/gpu.py auto_loop).

Issue 11 asks that speculation be never slower than greedy at batch 1..16, the Session choosing k
itself where no k pays (``num_speculative_tokens="auto"``); an auto Session's stretches of k = 0
steps and its runs of one k >= 1 run with the host a step ahead (``speculative/decoder.py``), like
a greedy Session's and a fixed k's.
Needs onnxruntime-gpu and ortspec._native built with CUDA. Converts models/tiny-qwen35 (float32)
and models/qwen35-python-20m (float16), then:

(1) tiny float32: an auto Session whose k is scripted (stretches of up to 12 k = 0 steps among
    single steps of k = 1..4; runs of k = 1..3 of several lengths among single steps of another
    k) against the greedy Session at batch 1, 3 and 16, without and with a stop token: tokens
    equal, k = 0 steps run ahead (all but single steps between two of k >= 1), speculative steps
    run (ahead where the script has runs of one k >= 1), graph fallbacks and invalidations 0;
(2) tiny float32: the scripted-draft state check (check_speculative) with scripted k, stretches
    pipelined, both commits, batch 3 and 16: every state within 1e-5 x (1 + its largest |value|) of a plain
    decode after every speculative commit and after every catch-up that ends a stretch (its drafts
    are scripted on the host, so its speculative steps run the plain loop: the pipelined speculative
    loop's states are checked by spec_loop on CUDA and, for auto k, by the CPU tests);
(3) trained float16: --rounds interleaved rounds (the order rotating) of greedy, auto and auto
    with pipelined=False (every step in the plain loop, as auto ran before its loops were pipelined),
    128 new tokens over the bench's prompts at batch 1, 4 and 16: tokens/s (median), auto/greedy,
    the steps auto ran at each k, and how many of them ran pipelined (k = 0 / k >= 1). The auto
    Sessions first run --warmup calls per batch (the chooser times every k before it trusts its
    costs). Requests whose auto tokens differ from greedy are counted, not failed: float16
    speculation has the default mode's caveat (README).

Prints one line per check and the speed table last; exits 1 if a check of (1) or (2) failed.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import ortspec
from ortspec.runtime.graphs import GraphSet
from ortspec.speculative.auto_k import ScriptedK

from .common import CODE_PROMPTS, IDENTITY_PROMPTS, TINY, TRAINED, Checks, add_loop_arguments, convert, graph_faults, \
    markdown_table, state_check_row_steps, write_json

SUMMARY = "auto k on CUDA: its k = 0 stretches and k >= 1 runs pipelined (tokens, states, fallbacks), tok/s vs greedy"
SCRIPTS = ([0] * 12 + [2, 3, 0, 0, 0, 4, 1], [3] + [0] * 7 + [1, 0, 0, 0, 0, 2],  # k per step, cycled
           [2] * 6 + [3] * 4 + [0, 0, 1, 1, 1, 4, 2, 0, 2, 2, 1])  # the last with runs of one k >= 1
LOOPS = ("greedy", "auto", "auto, plain loop")


def add_arguments(parser) -> None:
    add_loop_arguments(parser, "auto_loop", "tokens per request in the checks (1) and (2)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per batch size before the rounds")


def run(args) -> int:
    checks = Checks()
    tiny = convert(TINY, Path(args.out) / "tiny_float32", dtype="float32", max_length=512)
    identity(tiny, "tiny float32", IDENTITY_PROMPTS * 4, args.new_tokens, checks)
    states(tiny, "tiny float32", IDENTITY_PROMPTS * 4, args.new_tokens, checks)
    rows = []
    if args.rounds:
        trained = convert(TRAINED, Path(args.out) / "trained_float16", dtype="float16", max_length=512)
        prompts = [CODE_PROMPTS[i % len(CODE_PROMPTS)] for i in range(16)]
        rows = speed(trained, "trained float16", prompts, args.rounds, args.warmup, checks)
    write_json(args.json, checks.results)
    if rows:
        print("\n" + markdown_table(["model", "batch", *(f"{loop} tok/s" for loop in LOOPS), "auto/greedy",
                                     "auto steps by k", "auto pipelined (k = 0 / k ≥ 1)", "auto tokens ≠ greedy"],
                                    rows))
    return checks.exit_status("auto loop failures")


def identity(model, label: str, prompts: list, n: int, checks: Checks, provider: str = "cuda",
             loop_options: dict | None = None) -> None:
    """(1); loop_options: generate options that make the loop run where it is not the default (the CPU)."""
    options = dict(loop_options or {})
    greedy_session = ortspec.Session(model, provider=provider)
    stop = greedy_session.generate(prompts[0], max_new_tokens=n, stop_tokens=[])[n // 3]
    for batch in (1, 3, 16):
        for stops, script in (([], SCRIPTS[0]), ([stop], SCRIPTS[1]), ([], SCRIPTS[2])):
            greedy = greedy_session.generate(prompts[:batch], max_new_tokens=n, stop_tokens=stops)
            session = ortspec.Session(model, provider=provider, num_speculative_tokens="auto")
            session.k_chooser = ScriptedK(session.k, script)
            auto = session.generate(prompts[:batch], max_new_tokens=n, stop_tokens=stops, **options)
            stats = session.stats
            ok = (auto == greedy and 0 < stats["pipelined_steps"] <= stats["steps_by_k"][0]
                  and stats["speculative_steps"] > 0 and graph_faults(session) == 0
                  and (stats["pipelined_speculative_steps"] > 0) == has_runs(script))
            checks.record(f"{label} batch {batch} stop {stops} script {SCRIPTS.index(script)}", ok)
            print(f"{label}: batch {batch}, stop tokens {stops}, script {SCRIPTS.index(script)}: auto == greedy: "
                  f"{auto == greedy} (steps by k {stats['steps_by_k']}, pipelined {stats['pipelined_steps']} "
                  f"k = 0 and {stats['pipelined_speculative_steps']} k >= 1, graph faults {graph_faults(session)})")
            session.close()


def has_runs(script: list) -> bool:
    """Whether a script (cycled) has a k >= 1 twice in a row: a run of fused steps then runs a step
    ahead (a single step of k runs alone)."""
    return any(k >= 1 and k == script[(i + 1) % len(script)] for i, k in enumerate(script))


def states(model, label: str, prompts: list, n: int, checks: Checks, provider: str = "cuda") -> None:
    """(2): float32 states after every speculative commit and every catch-up that ends a stretch."""
    graphs = GraphSet(ortspec.Session(model).manifest, provider=provider)
    atol = 1e-5 if provider == "cuda" else 0.0
    for commit in ("select", "readvance"):
        for batch, script in ((3, SCRIPTS[0]), (16, SCRIPTS[1])):
            row_steps = state_check_row_steps(graphs, prompts[:batch], n, 4, commit, p=0.7, atol=atol,
                                              fixed_rows=True, pipelined=True, k_chooser=ScriptedK(4, script))
            checks.record(f"{label} {commit} batch {batch} states", row_steps is not None, row_steps)
            print(f"{label}: {commit}, batch {batch}: states within {atol} of a plain decode after every "
                  f"commit and catch-up: {row_steps is not None} ({row_steps} speculative row-steps)")
    graphs.close()


def speed(model, label: str, prompts: list, rounds: int, warmup: int, checks: Checks, provider: str = "cuda",
          new_tokens: int = 128, loop_options: dict | None = None) -> list[list]:
    """(3) over 16 prompts: one row per batch size (median tok/s per loop, auto/greedy, auto's steps
    by k in the timed rounds, requests whose auto tokens differ from greedy's)."""
    sessions = {"greedy": ortspec.Session(model, provider=provider),
                "auto": ortspec.Session(model, provider=provider, num_speculative_tokens="auto"),
                "auto, plain loop": ortspec.Session(model, provider=provider, num_speculative_tokens="auto")}
    options = {"greedy": dict(loop_options or {}), "auto": dict(loop_options or {}),
               "auto, plain loop": {**(loop_options or {}), "pipelined": False}}
    rows = []
    for batch in (1, 4, 16):
        def call(loop: str) -> list:
            return sessions[loop].generate(prompts[:batch], max_new_tokens=new_tokens, stop_tokens=[], **options[loop])

        outputs = {}
        for loop in LOOPS:
            for _ in range(max(warmup, 1)):
                outputs[loop] = call(loop)
        before = sessions["auto"].stats
        rates = {loop: [] for loop in LOOPS}
        for round_ in range(rounds):
            for loop in LOOPS[round_ % 3:] + LOOPS[: round_ % 3]:
                start = time.perf_counter()
                call(loop)
                rates[loop].append(batch * new_tokens / (time.perf_counter() - start))
        after = sessions["auto"].stats
        by_k = [b - (before["steps_by_k"][k] if k < len(before["steps_by_k"]) else 0)
                for k, b in enumerate(after["steps_by_k"])]
        piped = [after[name] - before[name] for name in ("pipelined_steps", "pipelined_speculative_steps")]
        differ = sum(a != g for a, g in zip(outputs["auto"], outputs["greedy"]))
        median = {loop: statistics.median(r) for loop, r in rates.items()}
        checks.results[f"{label} batch {batch}"] = {"tok/s": rates, "auto steps by k": by_k, "auto differ": differ,
                                                    "auto pipelined steps (k = 0, k >= 1)": piped}
        rows.append([label, batch, *(f"{median[loop]:.0f}" for loop in LOOPS),
                     f"{median['auto'] / median['greedy']:.2f}", by_k, " / ".join(map(str, piped)), differ])
    for session in sessions.values():
        session.close()
    return rows
