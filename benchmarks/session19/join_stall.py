"""How long a long prompt's join stalls the running requests: its prefill on the engine's thread
(add_requests waits for it) or on a thread of its own (add_requests(wait=False)).

    python3 benchmarks/session19/join_stall.py MODEL [--threads 1] [-k 2] [--long 900] [--rounds 4]

A batcher of 4 rows runs 3 requests (prompts of 12 token ids, 160 new tokens, no stop tokens);
after 10 steps a prompt of --long token ids joins for 16 tokens. Per side, the rounds alternating
the sides' order: the longest gap between two returns of step() (the add counted in it: what a
streaming client of a running request sees), the median gap, the running requests' tokens/s over
the run, and the joining request's time to its first token. Tokens are checked equal between sides.
"""
import argparse
import statistics
import time

import numpy as np

import ortspec


def run(session, apart: bool, long_prompt, short_prompts, tokens: int) -> dict:
    options = dict(background_prefill=True) if apart else {}
    with session.batcher(max_batch_size=4, **options) as batcher:
        ids = batcher.add_requests([dict(prompt=p, max_new_tokens=tokens, stop_tokens=[]) for p in short_prompts])
        gaps, steps, joined, first = [], 0, None, None
        start = last = time.perf_counter()
        while batcher.pending:
            if steps == 10:
                joined_at = time.perf_counter()
                joined = batcher.add_requests([dict(prompt=long_prompt, max_new_tokens=16, stop_tokens=[])],
                                              wait=not apart)[0]
            report = batcher.step()
            now = time.perf_counter()
            gaps.append(now - last)
            last, steps = now, steps + 1
            if joined is not None and first is None and report.get(joined):
                first = now - joined_at
        wall = time.perf_counter() - start
        return dict(max_gap=max(gaps) * 1e3, median_gap=statistics.median(gaps) * 1e3,
                    tok_s=len(short_prompts) * tokens / wall, ttft=first * 1e3,
                    tokens=[batcher.result(i) for i in ids + [joined]])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model"); p.add_argument("--threads", type=int, default=1); p.add_argument("-k", type=int, default=2)
    p.add_argument("--long", type=int, default=900); p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens", type=int, default=160)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    session = ortspec.Session(a.model, num_speculative_tokens=a.k, threads=a.threads)
    vocab = session.manifest.spec.vocab_size
    short = [rng.integers(3, vocab, 12).tolist() for _ in range(3)]
    long_prompt = rng.integers(3, vocab, a.long).tolist()
    results = {False: [], True: []}
    for side in (False, True):  # warm-up: every graph's session made, weights prepacked
        run(session, side, long_prompt, short, 24)
    for r in range(a.rounds):
        for side in ((False, True) if r % 2 == 0 else (True, False)):
            results[side].append(run(session, side, long_prompt, short, a.tokens))
            print(f"round {r} {'apart' if side else 'on the engine thread'}: " + ", ".join(
                f"{key} {value:.1f}" for key, value in results[side][-1].items() if key != "tokens"), flush=True)
    assert all(x["tokens"] == results[False][0]["tokens"] for side in results.values() for x in side)
    print(f"\n{a.model}, k = {a.k}, {a.threads} thread(s), a {a.long}-token prompt joins 3 running requests; "
          f"medians of {a.rounds} rounds; tokens equal: True")
    print("| prefill | longest gap between steps, ms | median gap, ms | running requests' tok/s | "
          "join's time to first token, ms |")
    print("|---|---|---|---|---|")
    for side, name in ((False, "on the engine thread"), (True, "on its own thread")):
        med = {key: statistics.median(x[key] for x in results[side]) for key in ("max_gap", "median_gap", "tok_s", "ttft")}
        print(f"| {name} | {med['max_gap']:.1f} | {med['median_gap']:.2f} | {med['tok_s']:.1f} | {med['ttft']:.1f} |")


if __name__ == "__main__":
    main()
