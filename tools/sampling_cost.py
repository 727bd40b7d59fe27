"""What sampling costs against greedy: one process, configurations interleaved round by round.

    python3 tools/sampling_cost.py out/qwen35-python-20m -k 0,2 --temperature 0.8 --rounds 5

Per k, greedy and sampled generate run the same batch of code prompts (cycled to --batch; stop
tokens off, so every round makes the same number of tokens), alternating; reported: the median
seconds per round, sampled / greedy, the acceptance of each, and a table of tokens/s with each
k's against the first k's (speculative sampling against plain sampling). Sampled rows draw on
the device where the model has the sampling graphs (decode_sample, verify_mtp_sample_k{k}).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ortspec  # noqa: E402
from tools.serve_load import PROMPTS  # noqa: E402


def timed_round(session, sampling: dict, batch: int, new_tokens: int) -> float:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    start = time.perf_counter()
    session.generate(prompts, max_new_tokens=new_tokens, stop_tokens=[], **sampling)
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("-k", default="0,2", help="comma-separated k values")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--provider", default="cpu", help="cpu or cuda")
    args = parser.parse_args(argv)
    print("k  greedy s  sampled s  sampled/greedy  acceptance greedy/sampled")
    rows = []
    for k in (int(x) for x in args.k.split(",")):
        sessions = {name: ortspec.Session(args.model, num_speculative_tokens=k, threads=args.threads,
                                           provider=args.provider)
                    for name in ("greedy", "sampled")}
        sampled = dict(temperature=args.temperature, top_p=args.top_p, seed=0)
        times = {"greedy": [], "sampled": []}
        for r in range(args.rounds + 1):  # round 0 warms up
            for name, options in (("greedy", {}), ("sampled", sampled)):
                seconds = timed_round(sessions[name], options, args.batch, args.new_tokens)
                if r:
                    times[name].append(seconds)
        greedy, sampled_s = statistics.median(times["greedy"]), statistics.median(times["sampled"])
        acceptance = [sessions[n].stats["acceptance_rate"] for n in ("greedy", "sampled")]
        print(f"{k}  {greedy:8.3f}  {sampled_s:9.3f}  {sampled_s / greedy:14.2f}  "
              f"{acceptance[0]:.2f} / {acceptance[1]:.2f}", flush=True)
        rows.append((k, args.batch * args.new_tokens / greedy, args.batch * args.new_tokens / sampled_s))
    base_greedy, base_sampled = rows[0][1], rows[0][2]
    print(f"\n| k | batch | greedy tok/s | sampled tok/s | sampled / greedy (same k) | greedy / greedy k={rows[0][0]} | "
          f"sampled / sampled k={rows[0][0]} |\n|---|---|---|---|---|---|---|")
    for k, greedy_rate, sampled_rate in rows:
        print(f"| {k} | {args.batch} | {greedy_rate:.0f} | {sampled_rate:.0f} | {sampled_rate / greedy_rate:.2f} | "
              f"{greedy_rate / base_greedy:.2f} | {sampled_rate / base_sampled:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
