"""The pipelined greedy loop on CUDA: identity with the plain loop, then its speed (python3 tools/gpu.py greedy_loop).

Needs onnxruntime-gpu and ortspec._native built with CUDA. Converts models/tiny-qwen35 (float32
and float16) and models/qwen35-python-20m (float16), then per model:

(1) Session.generate with the pipelined loop (the CUDA default) against pipelined=False, at
    batch 1, 3 (bucket 4) and 16: without stop tokens, and with a stop token that ends request
    0 early; tokens equal, pipelined_steps > 0 only where pipelined, graph fallbacks and
    invalidations 0;
(2) float32: after pipelined and plain runs of the same requests (equal budgets), every state of
    every row equal bitwise (the same graphs ran over the same inputs);
(3) --rounds interleaved rounds (plain, pipelined; the order alternating) of generate over the
    bench's prompts at batch 1, 4 and 16, 128 new tokens, no stop tokens: tokens/s (median)
    and pipelined/plain.

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
from ortspec.speculative.requests import Request
from ortspec.speculative.stats import Stats

from .common import CODE_PROMPTS, IDENTITY_PROMPTS, TINY, TRAINED, Checks, add_loop_arguments, convert, graph_faults, \
    markdown_table, write_json

SUMMARY = "pipelined greedy (host a step ahead) vs the plain loop on CUDA: tokens, states, fallbacks, tokens/s"
MODELS = (("tiny", TINY, "float32"), ("tiny", TINY, "float16"), ("trained", TRAINED, "float16"))


def add_arguments(parser) -> None:
    add_loop_arguments(parser, "greedy_loop")


def run(args) -> int:
    checks, rows = Checks(), []
    for name, source, dtype in MODELS:
        model = convert(source, Path(args.out) / f"{name}_{dtype}", dtype=dtype, max_length=512)
        label = f"{name} {dtype}"
        session = ortspec.Session(model, provider="cuda")
        prompts = token_prompts(session, name)
        identity(session, label, prompts, args.new_tokens, checks)
        if dtype == "float32":
            states_equal(model, label, prompts[:3], args.new_tokens, checks)
        if args.rounds and name == "trained":
            rows += speed(session, label, prompts, args.rounds, checks)
        session.close()
    write_json(args.json, checks.results)
    if rows:
        print("\n" + markdown_table(["model", "batch", "plain tok/s", "pipelined tok/s", "pipelined/plain"], rows))
    return checks.exit_status("identity failures")


def token_prompts(session, name: str) -> list[list[int]]:
    """16 prompts: the bench's code prompts (trained model) or the identity prompts, repeated."""
    base = [session.tokenizer.encode(p).ids for p in CODE_PROMPTS] if name == "trained" else IDENTITY_PROMPTS
    return [list(base[i % len(base)]) for i in range(16)]


def identity(session, label: str, prompts: list, n: int, checks: Checks) -> None:
    stop = session.generate(prompts[0], max_new_tokens=n, stop_tokens=[], pipelined=False)[n // 3]
    for batch in (1, 3, 16):
        for stops in ([], [stop]):
            session.reset_stats()
            plain = session.generate(prompts[:batch], max_new_tokens=n, stop_tokens=stops, pipelined=False)
            plain_steps = session.stats["pipelined_steps"]
            piped = session.generate(prompts[:batch], max_new_tokens=n, stop_tokens=stops)
            piped_steps = session.stats["pipelined_steps"] - plain_steps
            ok = piped == plain and plain_steps == 0 and piped_steps > 0 and graph_faults(session) == 0
            checks.record(f"{label} batch {batch} stop {stops}", ok)
            print(f"{label}: batch {batch}, stop tokens {stops}: pipelined == plain: {piped == plain} "
                  f"(pipelined steps {piped_steps}, graph faults {graph_faults(session)})")


def states_equal(model: Path, label: str, prompts: list, n: int, checks: Checks) -> None:
    graphs = GraphSet(ortspec.Session(model).manifest, provider="cuda")
    states = []
    for pipelined in (False, True):
        requests = [Request(row=i, prompt=p, max_new_tokens=n) for i, p in enumerate(prompts)]
        decoder = Decoder(graphs, len(prompts), 0, "select", Stats(), pipelined=pipelined)
        decoder.generate(requests)
        states.append([decoder.target.states.row_state(r.row, r.processed) for r in requests])
    different = [(row, name) for row, (a, b) in enumerate(zip(*states)) for name in a
                 if not np.array_equal(a[name], b[name])]
    checks.record(f"{label} states equal", not different, different or True)
    print(f"{label}: states after the run bitwise equal to the plain loop's: {not different} {different or ''}")
    graphs.close()


def speed(session, label: str, prompts: list, rounds: int, checks: Checks) -> list[list]:
    rows = []
    for batch in (1, 4, 16):
        rates = {False: [], True: []}
        session.generate(prompts[:batch], max_new_tokens=128, stop_tokens=[])  # warm-up: graphs captured
        session.generate(prompts[:batch], max_new_tokens=128, stop_tokens=[], pipelined=False)
        for round_ in range(rounds):
            for pipelined in ((False, True) if round_ % 2 == 0 else (True, False)):
                start = time.perf_counter()
                session.generate(prompts[:batch], max_new_tokens=128, stop_tokens=[], pipelined=pipelined)
                rates[pipelined].append(batch * 128 / (time.perf_counter() - start))
        plain, piped = statistics.median(rates[False]), statistics.median(rates[True])
        checks.results[f"{label} batch {batch} tok/s"] = {"plain": rates[False], "pipelined": rates[True]}
        rows.append([label, batch, f"{plain:.0f}", f"{piped:.0f}", f"{piped / plain:.2f}"])
    return rows
