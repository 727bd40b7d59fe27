"""KV window variants on CUDA against the portable graph (python3 tools/gpu.py kv_windows).

Needs onnxruntime-gpu and ortspec._native built with CUDA. A CUDA Session runs each captured
graph's KV window variant (converter/kv_windows.py: attend over the first W = 256, 512, ... slots
past the positions) where the model has them; ``session.graphs.kv_windows.variants = False``
runs the same Session over all max_length slots, the portable graphs. Converts
models/tiny-qwen35 in float32 at max_length 1024 (W = 256, 512) and models/qwen35-python-20m in
float16 at --max-length (default 4096: W = 256 .. 2048), then:

(1) identity, tiny float32: generate with the variants against without, k = 0 and 3, batch 1, 3
    and 16, prompts of 1..500 tokens (runs that cross W = 256 and 512): tokens equal; the
    variants' slots (decode.w256/M1/B1/engine0, ...) captured and replayed; graph fallbacks and
    invalidations 0;
(2) states, tiny float32: after the same requests with and without variants (plain loop, and
    the pipelined loops), every state of every row within 1e-5 x (1 + its largest magnitude)
    (the products' kernels may change with W), and whether bitwise;
(3) speed, trained float16: --rounds interleaved rounds (variants on, off; the order
    alternating) of generate over the bench's code prompts at batch 1 and 16, k = 0 and 3, 128
    new tokens: tokens/s (median) and on/off.

Prints one line per check and the speed table last; exits 1 if an identity check failed.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

import ortspec
from ortspec.runtime.graphs import GraphSet
from ortspec.speculative.decoder import Decoder
from ortspec.speculative.exactness import within
from ortspec.speculative.requests import Request
from ortspec.speculative.stats import Stats

from .common import CODE_PROMPTS, IDENTITY_PROMPTS, TINY, TRAINED, Checks, add_loop_arguments, convert, graph_faults, \
    markdown_table, write_json

SUMMARY = "KV window variants vs the portable graphs on CUDA: tokens, states, graph counters, tokens/s"
STATE_ATOL = 1e-5  # the GPU state tolerance of the exactness checks (README, speculative.exactness.within)


def add_arguments(parser) -> None:
    add_loop_arguments(parser, "kv_windows")
    parser.add_argument("--max-length", type=int, default=4096, help="max_length of the trained model's conversion")


def run(args) -> int:
    checks, out = Checks(), Path(args.out)
    tiny = convert(TINY, out / "tiny_float32", dtype="float32", max_length=1024)
    prompts = long_prompts()
    for k in (0, 3):
        identity(tiny, k, prompts, args.new_tokens, checks)
    for k in (0, 3):
        for pipelined in (False, True):
            states(tiny, prompts[:3], args.new_tokens, k, pipelined, checks)
    rows = []
    if args.rounds:
        trained = convert(TRAINED, out / f"trained_float16_{args.max_length}", dtype="float16",
                          max_length=args.max_length)
        rows = speed(trained, args.rounds, checks)
    write_json(args.json, checks.results)
    if rows:
        print("\n" + markdown_table(["model", "k", "batch", "all slots tok/s", "windows tok/s", "windows/all"], rows))
    return checks.exit_status("identity failures")


def long_prompts() -> list[list[int]]:
    """16 prompts: 240- and 500-token ones (their runs cross W = 256 and 512), then the identity prompts."""
    long = [list(np.arange(n) % 300 + 1) for n in (240, 500)]
    return [(long + IDENTITY_PROMPTS)[i % (len(IDENTITY_PROMPTS) + 2)] for i in range(16)]


def window_slots(session) -> dict:
    """The graph counters of the variants' slots (names with a .wW suffix)."""
    return {slot: c for slot, c in session.stats["graphs"].items() if ".w" in slot.split("/")[0]}


def identity(model: Path, k: int, prompts: list, n: int, checks: Checks) -> None:
    session = ortspec.Session(model, provider="cuda", num_speculative_tokens=k)
    for batch in (1, 3, 16):
        session.graphs.kv_windows.variants = False
        full = session.generate(prompts[:batch], max_new_tokens=n)
        session.graphs.kv_windows.variants = True
        windowed = session.generate(prompts[:batch], max_new_tokens=n)
        checks.record(f"tokens k={k} batch {batch}", windowed == full)
        print(f"tiny float32 k={k} batch {batch}: tokens with windows == over all slots: {windowed == full}")
    slots = window_slots(session)
    replayed = any(c["replays"] > 0 for c in slots.values())
    checks.record(f"k={k} variants captured and replayed", replayed, slots)
    checks.record(f"k={k} graph faults", graph_faults(session) == 0, graph_faults(session))
    print(f"k={k}: variant slots {sorted(slots)}, replayed: {replayed}, graph faults: {graph_faults(session)}")
    session.close()


def states(model: Path, prompts: list, n: int, k: int, pipelined: bool, checks: Checks) -> None:
    graphs = GraphSet(ortspec.Session(model).manifest, provider="cuda")
    runs = []
    for variants in (False, True):
        graphs.kv_windows.variants = variants
        requests = [Request(row=i, prompt=p, max_new_tokens=n) for i, p in enumerate(prompts)]
        decoder = Decoder(graphs, len(prompts), k, "select", Stats(), pipelined=pipelined)
        decoder.generate(requests)
        runs.append([{**decoder.target.states.row_state(r.row, r.processed),
                      **(decoder.mtp.row_state(r.row, r.processed) if k else {})} for r in requests])
    label = f"states k={k} {'pipelined' if pipelined else 'plain'}"
    pairs = [(row, name, a[name], b[name]) for row, (a, b) in enumerate(zip(*runs)) for name in a]
    bitwise = all(np.array_equal(x, y) for _, _, x, y in pairs)
    off = [(row, name, float(np.max(np.abs(x - y))) if x.shape == y.shape else f"shape {y.shape} vs {x.shape}")
           for row, name, x, y in pairs if x.shape != y.shape or not within(y, x, STATE_ATOL)]
    checks.record(label, not off, {"bitwise": bitwise, "outside tolerance": off})
    print(f"tiny float32 {label}: within {STATE_ATOL}: {not off}, bitwise: {bitwise} {off or ''}")
    graphs.close()


def speed(model: Path, rounds: int, checks: Checks) -> list[list]:
    rows = []
    for k in (0, 3):
        session = ortspec.Session(model, provider="cuda", num_speculative_tokens=k)
        prompts = [session.tokenizer.encode(CODE_PROMPTS[i % len(CODE_PROMPTS)]).ids for i in range(16)]
        label = f"trained float16 L={session.manifest.max_length}"
        for batch in (1, 16):
            rates = {False: [], True: []}
            for variants in (False, True):  # warm-up: every graph captured
                session.graphs.kv_windows.variants = variants
                session.generate(prompts[:batch], max_new_tokens=128, stop_tokens=[])
            for round_ in range(rounds):
                for variants in ((False, True) if round_ % 2 == 0 else (True, False)):
                    session.graphs.kv_windows.variants = variants
                    start = time.perf_counter()
                    session.generate(prompts[:batch], max_new_tokens=128, stop_tokens=[])
                    rates[variants].append(batch * 128 / (time.perf_counter() - start))
            full, windowed = statistics.median(rates[False]), statistics.median(rates[True])
            checks.results[f"{label} k={k} batch {batch} tok/s"] = {"all slots": rates[False], "windows": rates[True]}
            rows.append([label, k, batch, f"{full:.0f}", f"{windowed:.0f}", f"{windowed / full:.3f}"])
        checks.record(f"trained k={k} graph faults", graph_faults(session) == 0, graph_faults(session))
        session.close()
    return rows
