"""What sampling on the device costs per step against greedy: decode_sample against decode and
verify_mtp_sample_k{k} against verify_mtp_k{k}, through the runtime's entry points (the Session's
loop does not call the sampling graphs yet), steps interleaved round by round.

    python3 tools/device_sampling_cost.py out/model --batch 1,4 -k 0,3 --threads 1 --temperature 0.8
    python3 tools/device_sampling_cost.py out/model --provider cuda --batch 1,16 -k 0,3 --top-p 0.95

Per k and batch: every row prefilled with one prompt, then per round --steps greedy steps and
--steps sampled ones from there (each commits as the loop would: decode advances its states; a
fused step selects slot a and writes the head's entries), the order alternating; reported: the
median milliseconds per step of each, and sampled / greedy. At depth 0 (the CPU) a plain
decode step emits one token either way, so the ratio of step times is the ratio of tokens/s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ortspec.manifest import Manifest  # noqa: E402
from ortspec.runtime.graphs import GraphSet  # noqa: E402
from ortspec.runtime.model import MTPHead, TargetModel  # noqa: E402
from ortspec.runtime.sampling_inputs import SamplingInputs  # noqa: E402
from ortspec.runtime.states import Rows  # noqa: E402

PROMPT = [11, 7, 3, 250, 99, 17, 5, 42]


class Steps:
    """One engine of B rows, prefilled; ``run(sampled, n)`` times n steps of either kind from the prompt."""

    def __init__(self, graphs: GraphSet, batch: int, k: int, params: dict, rng, clock=time.perf_counter) -> None:
        self.graphs, self.k, self.rng, self.params, self.clock = graphs, k, rng, params, clock
        self.target, self.rows = TargetModel(graphs, batch), Rows(range(batch))
        self.head = MTPHead(graphs, batch, k) if k else None
        self.batch = batch

    def inputs(self, draws: int) -> SamplingInputs:
        B, p = self.batch, self.params
        return SamplingInputs(np.full(B, p["temperature"], np.float32), np.full(B, p["top_k"], np.int64),
                              np.full(B, p["top_p"], np.float32), np.full(B, p["min_p"], np.float32),
                              self.rng.random((B, draws), dtype=np.float32))

    def prefill(self) -> tuple[np.ndarray, np.ndarray | None]:
        n, B = len(PROMPT), self.batch
        ids, positions = np.tile(PROMPT, (B, 1)), np.tile(np.arange(n), (B, 1))
        self.target.reset(self.rows)
        out = self.target.prefill(self.rows, ids, positions)
        pending = out.tokens[:, -1]
        if not self.k:
            return pending, None
        next_ids = np.concatenate([ids[:, 1:], pending[:, None]], axis=1)
        drafts, _ = self.head.catch_up_sampled(self.rows, out["hidden"], next_ids, positions, np.full(B, n - 1),
                                               self.k, self.inputs(self.k), graphed=False, on_device=True)
        return pending, drafts

    def run(self, sampled: bool, steps: int) -> float:
        """Median seconds per step over ``steps`` steps after the prefill."""
        pending, drafts = self.prefill()
        T, times = np.full(self.batch, len(PROMPT), np.int64), []
        for _ in range(steps):
            start = self.clock()
            if not self.k:
                run = self.target.decode_sampled if sampled else self.target.decode
                extra = (self.inputs(1),) if sampled else ()
                out = run(self.rows, pending[:, None], T[:, None], *extra)
                pending, T = out.tokens[:, 0], T + 1
            else:
                positions = T[:, None] + np.arange(self.k + 1)
                ids = np.concatenate([pending[:, None], drafts], axis=1)
                if sampled:
                    out, accepted, drafts = self.target.verify_with_head_sampled(self.rows, ids, positions, self.head,
                                                                                 self.inputs(2 * self.k + 1))
                else:
                    out, accepted, drafts = self.target.verify_with_head(self.rows, ids, positions, self.head)
                self.target.select(out, self.rows, positions, accepted)
                self.head.write_entries(out, self.rows, positions, accepted)
                pending, T = out.tokens[np.arange(self.batch), accepted], T + accepted + 1
            times.append(self.clock() - start)
        return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("-k", default="0", help="comma-separated k values (0: decode_sample against decode)")
    parser.add_argument("--batch", default="1,4", help="comma-separated batch sizes")
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall: elapsed time; cpu: the process's CPU time (every thread's), which other "
                             "processes sharing the cores do not inflate")
    parser.add_argument("--provider", default="cpu", help="cpu or cuda (captured graphs; the host waits every step)")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per round and kind")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (plus one to warm up)")
    args = parser.parse_args(argv)
    graphs = GraphSet(Manifest.load(args.model), provider=args.provider, threads=args.threads)
    params = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    print(f"{args.model.name} V={graphs.manifest.spec.vocab_size} {args.provider} threads={args.threads} {params} "
          f"({args.clock} time)")
    print("k  batch  greedy ms/step  sampled ms/step  sampled/greedy")
    for k in (int(x) for x in args.k.split(",")):
        for batch in (int(b) for b in args.batch.split(",")):
            clock = time.process_time if args.clock == "cpu" else time.perf_counter
            steps, times = Steps(graphs, batch, k, params, np.random.default_rng(0), clock), {False: [], True: []}
            for r in range(args.rounds + 1):
                for sampled in ((False, True) if r % 2 else (True, False)):
                    seconds = steps.run(sampled, args.steps)
                    if r:
                        times[sampled].append(seconds)
            greedy, sampled = (1e3 * statistics.median(times[s]) for s in (False, True))
            print(f"{k}  {batch:5d}  {greedy:14.2f}  {sampled:15.2f}  {sampled / greedy:14.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
