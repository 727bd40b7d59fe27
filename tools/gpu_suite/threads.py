"""One caller per state on CUDA: threads, batchers and generate calls on one Session (python3 tools/gpu.py threads).

Needs onnxruntime-gpu and ortspec._native built with CUDA. Converts models/tiny-qwen35 (fp32
and fp16) and, per dtype, on provider="cuda" with CUDA graphs checks
(1) 4 threads x 3 calls over Sessions of k = 0, 2 (select) and 3 (readvance), batch sizes
    1, 2, 3 (bucket 4) and 5 (bucket 8): every output equals the same call run alone;
(2) a batcher of 1 row and one of 2 rows with generate calls of both sizes between their steps;
(3) two batchers of 2 rows stepped alternately;
(4) every CUDA-graph slot: fallbacks 0 and invalidations 0, at most one capture (slots are
    keyed by engine, so engines of one size alternating never invalidate each other);
(5) Session.close(): device memory after three open / generate / close cycles stays flat.
Prints one line per check and exits non-zero on any failure. ``check_one_caller_per_state``
is the whole check as one function, for a combined GPU entry point.
"""

from __future__ import annotations

import threading
from pathlib import Path

import ortspec

from .common import TINY, convert, write_json

SUMMARY = "threads, batchers and generate calls on one CUDA Session equal their solo runs; graph slots per engine"

PROMPTS = [[5, 17, 99, 3, 250, 7, 11], [42], [8, 8, 8, 300, 1, 2, 3, 4, 5], [1, 2], [400, 3, 3, 3], [77] * 9]
SIZES = (1, 2, 3, 5)


def calls(threads: int = 4, rounds: int = 3) -> list[tuple[int, list, int]]:
    """(session index, prompts, max_new_tokens): in every round threads 0 and 1 (and 2 and 3)
    run the same Session at the same batch size with other prompts."""
    out = []
    for r in range(rounds):
        for t in range(threads):
            pair = r + t // 2
            prompts = [PROMPTS[(r + 2 * t + j) % len(PROMPTS)] for j in range(SIZES[pair % len(SIZES)])]
            out.append((pair % 3, prompts, 24 + 4 * t))
    return out


def threaded_mismatches(sessions, threads: int = 4) -> list[int]:
    todo = calls(threads)
    alone = [sessions[s].generate(p, max_new_tokens=n) for s, p, n in todo]
    results, errors = [None] * len(todo), []
    start = threading.Barrier(threads)

    def worker(t):
        try:
            start.wait(timeout=60)
            for i in range(t, len(todo), threads):
                s, prompts, n = todo[i]
                results[i] = sessions[s].generate(prompts, max_new_tokens=n)
        except BaseException as error:
            errors.append(error)

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return [i for i in range(len(todo)) if results[i] != alone[i]]


def batchers_with_generate(session) -> bool:
    alone = [session.generate(p, max_new_tokens=40) for p in PROMPTS[:3]]
    pair = session.generate(PROMPTS[3:5], max_new_tokens=6)
    ok = True
    with session.batcher(max_batch_size=1) as one, session.batcher(max_batch_size=2) as two:
        ids = [one.add_request(PROMPTS[0], 40), two.add_request(PROMPTS[1], 40), two.add_request(PROMPTS[2], 40)]
        while one.pending or two.pending:
            for batcher in (one, two):
                if batcher.pending:
                    batcher.step()
            ok &= session.generate(PROMPTS[3], max_new_tokens=6) == pair[0]
            ok &= session.generate(PROMPTS[3:5], max_new_tokens=6) == pair
        ok &= [one.result(ids[0]), two.result(ids[1]), two.result(ids[2])] == alone
    return ok


def two_batchers_alternating(session) -> bool:
    lengths = (40, 25, 33, 48)
    alone = [session.generate(p, max_new_tokens=n) for p, n in zip(PROMPTS, lengths)]
    with session.batcher(max_batch_size=2) as first, session.batcher(max_batch_size=2) as second:
        owners = [first, second, first, second]
        ids = [b.add_request(p, n) for b, p, n in zip(owners, PROMPTS, lengths)]
        while first.pending or second.pending:
            for batcher in (first, second):
                if batcher.pending:
                    batcher.step()
        return [b.result(i) for b, i in zip(owners, ids)] == alone


def bad_slots(session) -> dict:
    return {slot: c for slot, c in session.stats["graphs"].items()
            if c["fallbacks"] or c["invalidations"] or c["captures"] > 1}


def shapes_on_several_engines(session) -> int:
    """Graph shapes ("graph/M/B") captured for more than one engine: proof that engines alternated."""
    engines: dict = {}
    for slot in session.stats["graphs"]:
        shape, engine = slot.rsplit("/", 1)
        engines.setdefault(shape, set()).add(engine)
    return sum(len(found) > 1 for found in engines.values())


def device_mib_after_cycles(model: Path, cycles: int = 3) -> list[float] | None:
    """Device memory in use after each open / generate / close cycle (None without torch)."""
    try:
        import torch
    except ImportError:
        return None
    used = []
    for _ in range(cycles):
        with ortspec.Session(model, provider="cuda", num_speculative_tokens=2) as session:
            session.generate(PROMPTS[:3], max_new_tokens=32)
            with session.batcher(max_batch_size=2) as batcher:
                batcher.add_request(PROMPTS[0], 8)
                batcher.step()
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        used.append((total - free) / 2**20)
    return used


def check_one_caller_per_state(model: Path, label: str = "") -> tuple[list[str], dict]:
    """All checks on one converted model; returns (failures, results)."""
    failures, results = [], {}
    sessions = [ortspec.Session(model, provider="cuda"),
                ortspec.Session(model, provider="cuda", num_speculative_tokens=2),
                ortspec.Session(model, provider="cuda", num_speculative_tokens=3, commit="readvance",
                                max_engines_per_batch_size=2)]
    wrong = threaded_mismatches(sessions)
    results["threads_wrong"] = wrong
    print(f"{label} 4 threads x 3 calls, k = 0/2/3, batch 1/2/3/5: wrong outputs {wrong}")
    failures += [f"{label} threads: calls {wrong} differ from their solo runs"] if wrong else []
    for name, check in (("batchers + generate", batchers_with_generate), ("two batchers", two_batchers_alternating)):
        ok = check(sessions[1])
        results[name] = ok
        print(f"{label} {name}: equal to solo runs: {ok}")
        failures += [] if ok else [f"{label} {name} differ from their solo runs"]
    for s in sessions:
        bad, shared = bad_slots(s), shapes_on_several_engines(s)
        results.setdefault("bad_slots", []).append(bad)
        print(f"{label} k={s.k}: {len(s.stats['graphs'])} graph slots ({shared} shapes on several engines), "
              f"engines {s.stats['engines']}, bad: {bad}")
        failures += [f"{label} k={s.k} graph slots with fallbacks/invalidations/recaptures: {bad}"] if bad else []
        failures += [] if shared else [f"{label} k={s.k}: no graph shape ran on two engines (nothing alternated)"]
        s.close()
    used = device_mib_after_cycles(model)
    results["device_mib_after_close"] = used
    print(f"{label} device MiB after each open/generate/close cycle: {used}")
    if used is not None and max(used) - min(used) > 16:
        failures.append(f"{label} device memory grows across Session open/close cycles: {used} MiB")
    return failures, results


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="/tmp/ortspec_gpu_threads", help="working directory (converted models)")


def run(args) -> int:
    failures, results = [], {}
    for dtype in ("float32", "float16"):
        model = convert(TINY, Path(args.out) / dtype, dtype=dtype, max_length=512)
        found, results[dtype] = check_one_caller_per_state(model, label=dtype)
        failures += found
    write_json(args.json, results)
    print("failures:", failures or "none")
    return 1 if failures else 0
