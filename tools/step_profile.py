"""Where a CPU generate call's time goes, step by step: ONNX Runtime's Runs against the host's own work.

    python tools/step_profile.py MODEL_DIR [-k 0,2] [--batch 4] [--threads 1] [--calls 8]
                                 [--prompts FILE] [--new-tokens 64]

For each k a Session runs --calls generate calls of ``ortspec bench``'s prompts (or --prompts,
a JSON list of texts) after two warm-up calls. Each prefill group and each step is timed from
outside (``Decoder._prefill_forward``, ``Decoder.step``) and each graph Run from inside
(``GraphRunner.run``), so every row of the table splits its time into the Runs and the host's
work around them (feeds, commits, acceptance, bookkeeping). Rows: the prefill groups by prompt
length, and the steps by the rows they ran: all of the batch, or (the static batch's tail, once
requests finish) fewer; "subset" marks rows that are not contiguous, which the CPU gathers.
Per row: how many per call, the median ms of one, of its Runs and of the rest, and ms per call.
The calls' own median wall time closes each table (what ``ortspec bench`` times).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import ortspec  # noqa: E402
from ortspec.bench import _prompts, read_prompts  # noqa: E402
from ortspec.runtime.graphs import GraphRunner  # noqa: E402
from ortspec.speculative.decoder import Decoder  # noqa: E402


class RunClock:
    """Times Decoder._prefill_forward / _prefill_finish, Decoder.step and GraphRunner.run while
    ``installed``: records (what, seconds, seconds inside Runs) per prefill group (its forward,
    then its host side) and per step that ran."""

    def __init__(self) -> None:
        self.records: list[tuple[str, float, float]] = []
        self._in_runs = 0.0

    @contextlib.contextmanager
    def installed(self):
        originals = Decoder._prefill_forward, Decoder._prefill_finish, Decoder.step, GraphRunner.run
        clock = self

        def run(runner, feeds, slot=None, wait=True):
            start = time.perf_counter()
            try:
                return originals[3](runner, feeds, slot, wait)
            finally:
                clock._in_runs += time.perf_counter() - start

        def prefill_forward(decoder, requests, *args, **kwargs):
            with clock._timed(f"prefill, {len(requests)} x {len(requests[0].prompt)} tokens"):
                return originals[0](decoder, requests, *args, **kwargs)

        def prefill_finish(decoder, requests, *args, **kwargs):
            with clock._timed(f"prefill's first tokens, {len(requests)} x {len(requests[0].prompt)} tokens"):
                return originals[1](decoder, requests, *args, **kwargs)

        def step(decoder):
            occupants = [r for r in decoder.occupants if r is not None]
            live = [r.row for r in occupants if not r.done]
            contiguous = live == list(range(live[0], live[0] + len(live))) if live else True
            label = (f"step, k={decoder.next_k}, {len(live)} of {len(occupants)} rows"
                     + ("" if contiguous else " (subset)"))
            with clock._timed(label):
                return originals[2](decoder)

        Decoder._prefill_forward, Decoder._prefill_finish, Decoder.step, GraphRunner.run = \
            prefill_forward, prefill_finish, step, run
        try:
            yield self
        finally:
            Decoder._prefill_forward, Decoder._prefill_finish, Decoder.step, GraphRunner.run = originals

    @contextlib.contextmanager
    def _timed(self, label: str):
        self._in_runs, start = 0.0, time.perf_counter()
        yield
        self.records.append((label, time.perf_counter() - start, self._in_runs))


def profile_calls(model: str, k: int, batch: int, threads: int, calls: int, texts: list[str] | None,
                  new_tokens: int) -> tuple[list[dict], float]:
    """(rows of the table, the calls' median wall seconds) for one k (see the module docstring)."""
    session = ortspec.Session(model, provider="cpu", num_speculative_tokens=k, threads=threads)
    prompts = _prompts(session, batch, texts)
    for _ in range(2):
        session.generate(prompts, max_new_tokens=new_tokens)
    clock, walls = RunClock(), []
    with clock.installed():
        for _ in range(calls):
            start = time.perf_counter()
            session.generate(prompts, max_new_tokens=new_tokens)
            walls.append(time.perf_counter() - start)
    groups = collections.defaultdict(list)
    for label, seconds, in_runs in clock.records:
        if not label.startswith("step") or " 0 of " not in label:  # the call's last check finds no live row
            groups[label].append((seconds, in_runs))
    rows = [{"what": label, "per_call": len(times) / calls,
             "ms": 1e3 * statistics.median(s for s, _ in times),
             "run_ms": 1e3 * statistics.median(r for _, r in times),
             "host_ms": 1e3 * statistics.median(s - r for s, r in times),
             "ms_per_call": 1e3 * sum(s for s, _ in times) / calls} for label, times in groups.items()]
    return rows, statistics.median(walls)


def table(rows: list[dict], wall: float) -> str:
    lines = ["| what | per call | ms each | Run ms | host ms | ms per call |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['what']} | {r['per_call']:.1f} | {r['ms']:.2f} | {r['run_ms']:.2f} | "
                     f"{r['host_ms']:.3f} | {r['ms_per_call']:.1f} |")
    lines.append(f"| the call (median wall) | 1 | | | | {1e3 * wall:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("-k", "--k", default="0,2", help="comma-separated k values")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=8, help="generate calls timed per k")
    parser.add_argument("--prompts", help="a JSON list of prompt texts (default: ortspec bench's)")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    texts = read_prompts(args.prompts) if args.prompts else None
    for k in (int(x) for x in args.k.split(",")):
        rows, wall = profile_calls(args.model, k, args.batch, args.threads, args.calls, texts, args.new_tokens)
        print(f"\n### k={k}, batch {args.batch}, {args.threads} thread(s), {args.calls} calls of {args.new_tokens} "
              "new tokens\n")
        print(table(rows, wall))
    return 0


if __name__ == "__main__":
    sys.exit(main())
