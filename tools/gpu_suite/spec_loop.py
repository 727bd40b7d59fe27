"""The pipelined speculative loop on CUDA: identity with the plain loop, then its speed (python3 tools/gpu.py spec_loop).

Needs onnxruntime-gpu and ortspec._native built with CUDA. Converts models/tiny-qwen35 (float32
and float16) and models/qwen35-python-20m (float16), then per model and k = 1..4:

(1) Session.generate (num_speculative_tokens=k) with the pipelined speculative loop (the CUDA
    default) against pipelined=False (the plain loop, one fused Run per step), at batch 1, 3
    (bucket 4) and 16: without stop tokens, and with a stop token that ends request 0 early;
    tokens equal, pipelined_speculative_steps > 0 only where pipelined, graph fallbacks and
    invalidations 0. Whether the tokens also equal greedy's (k = 0) is printed, not checked
    (float16 M=1 and M=k+1 products may round apart);
(2) float32, batch 3: each request's target and MTP states at its end (right after the step that
    ended it, before the next is enqueued: ``request_end_states``) against the plain loop's at its
    end: bitwise where that step ran the same rows in both loops (the same graph over the same
    inputs); where it did not (the plain loop plans each step anew and steps a smaller CUDA-graph
    bucket once rows finish, the pipelined run keeps its rows to its end, so a request's last step
    can run another kernel) within 1e-5 x (1 + the state's largest |value|), as check's state check;
(3) --rounds interleaved rounds on the trained model of generate over the bench's prompts at
    batch 1, 4 and 16, 128 new tokens, no stop tokens: pipelined greedy (k = 0), the plain
    speculative loop and the pipelined one at each k: tokens/s (median), tokens per step, and
    efficiency = (tokens/s / pipelined greedy's) / tokens per step.

Prints one line per check and the speed table last; exits 1 if an identity check failed.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path
from unittest import mock

import numpy as np

import ortspec
from ortspec.runtime.fused_run import FusedRun
from ortspec.runtime.graphs import GraphSet
from ortspec.speculative.decoder import Decoder
from ortspec.speculative.step_kinds import FusedSteps
from ortspec.speculative.requests import Request
from ortspec.speculative.stats import Stats

from .common import Checks, add_loop_arguments, convert, graph_faults, markdown_table, write_json
from .greedy_loop import MODELS, token_prompts

SUMMARY = "pipelined speculation (host a step ahead, k = 1..4) vs the plain loop on CUDA: tokens, states, tok/s"
KS = (1, 2, 3, 4)


def add_arguments(parser) -> None:
    add_loop_arguments(parser, "spec_loop")


def run(args) -> int:
    checks, rows = Checks(), []
    for name, source, dtype in MODELS:
        model = convert(source, Path(args.out) / f"{name}_{dtype}", dtype=dtype, max_length=512)
        label = f"{name} {dtype}"
        prompts = token_prompts(ortspec.Session(model), name)
        greedy = ortspec.Session(model, provider="cuda")
        for k in KS:
            session = ortspec.Session(model, provider="cuda", num_speculative_tokens=k)
            identity(session, greedy, f"{label} k={k}", prompts, args.new_tokens, checks)
            if dtype == "float32":
                states_equal(model, f"{label} k={k}", k, prompts[:3], args.new_tokens, checks)
            session.close()
        if args.rounds and name == "trained":
            rows += speed(model, greedy, label, prompts, args.rounds, checks)
        greedy.close()
    write_json(args.json, checks.results)
    if rows:
        print("\n" + markdown_table(["model", "batch", "k", "greedy (pipelined) tok/s", "plain spec tok/s",
                                     "pipelined spec tok/s", "tokens/step", "pipelined/plain", "efficiency"], rows))
    return checks.exit_status("identity failures")


def identity(session, greedy, label: str, prompts: list, n: int, checks: Checks) -> None:
    stop = greedy.generate(prompts[0], max_new_tokens=n, stop_tokens=[])[n // 3]
    for batch in (1, 3, 16):
        for stops in ([], [stop]):
            session.reset_stats()
            plain = session.generate(prompts[:batch], max_new_tokens=n, stop_tokens=stops, pipelined=False)
            plain_steps = session.stats["pipelined_speculative_steps"]
            piped = session.generate(prompts[:batch], max_new_tokens=n, stop_tokens=stops)
            piped_steps = session.stats["pipelined_speculative_steps"] - plain_steps
            faults = graph_faults(session)
            as_greedy = piped == greedy.generate(prompts[:batch], max_new_tokens=n, stop_tokens=stops)
            checks.record(f"{label} batch {batch} stop {stops}",
                          piped == plain and plain_steps == 0 and piped_steps > 0 and faults == 0)
            print(f"{label}: batch {batch}, stop tokens {stops}: pipelined == plain: {piped == plain} "
                  f"(pipelined steps {piped_steps}, graph faults {faults}; == greedy: {as_greedy})")


@contextlib.contextmanager
def request_end_states():
    """Records, while open, each request's target and MTP states (every position) right after the
    fused step that ended it, before the next step is enqueued (on CUDA the download waits for the
    stream up to that step's commit): yields {row: (request, (target, mtp), steps read so far,
    rows of that step)}."""
    after_step, ends, reads = {}, {}, [0]
    enqueue, record = FusedRun.enqueue, Decoder._record

    def recorded(self, n, *args, **kwargs):
        enqueue(self, n, *args, **kwargs)
        L = self.graphs.manifest.max_length
        after_step[(id(self), n)] = {row: (self.target.states.row_state(row, L), self.mtp.row_state(row, L))
                                     for row in self.rows.indices}

    def taken(self, flight, result, *args, **kwargs):
        running = [r for r in flight.run.requests if not r.done]
        record(self, flight, result, *args, **kwargs)
        steps = flight.run.steps
        if isinstance(steps, FusedSteps):
            reads[0] += 1
            states = after_step[(id(steps.run), flight.n)]
            ends.update({r.row: (r, states[r.row], reads[0], len(flight.run.requests)) for r in running if r.done})

    with mock.patch.object(FusedRun, "enqueue", recorded), mock.patch.object(Decoder, "_record", taken):
        yield ends


@contextlib.contextmanager
def step_rows():
    """Records, while open, the rows of each step the decoder reads: yields a list, one entry per step."""
    rows, record = [], Decoder._record

    def taken(self, flight, result, *args, **kwargs):
        rows.append(len(flight.run.requests))
        record(self, flight, result, *args, **kwargs)

    with mock.patch.object(Decoder, "_record", taken):
        yield rows


def differences(ends: dict, wanted, atol: float = 1e-5) -> list[str]:
    """Each recorded request end against wanted(row, length) -> (target, mtp[, rows of its last
    step]) state dicts cut to its live positions (a plain loop's or a plain decode's): names of
    what differs (bitwise, or where the other's last step ran other rows, beyond atol x (1 + the
    state's largest |value|))."""
    diffs = []
    for row, (req, states, _, rows) in ends.items():
        wanted_states = wanted(row, req.processed)
        theirs_both, their_rows = wanted_states[:2], (wanted_states[2:] or (rows,))[0]
        same_shape = rows == their_rows
        for label, mine, theirs in zip(("target", "MTP"), states, theirs_both):
            for name, value in theirs.items():
                cut = mine[name][tuple(slice(0, s) for s in value.shape)]
                close = (np.array_equal(cut, value) if same_shape else
                         np.abs(cut.astype(np.float64) - value).max(initial=0.0) <= atol * (1 + np.abs(value).max(initial=0.0)))
                if not close:
                    diffs.append(f"row {row} length {req.processed}: {label} {name} "
                                 f"({'bitwise' if same_shape else f'rows {rows} against {their_rows}, beyond {atol}'})")
    return diffs


def states_equal(model: Path, label: str, k: int, prompts: list, n: int, checks: Checks) -> None:
    graphs = GraphSet(ortspec.Session(model).manifest, provider="cuda")
    plain_ends = {}

    def at_end(decoder, batch):  # the plain loop: each request's states at the step that ended it
        for req in batch.requests:
            if req.done and req.row not in plain_ends:
                plain_ends[req.row] = (decoder.target.states.row_state(req.row, req.processed),
                                       decoder.mtp.row_state(req.row, req.processed), rows[-1])

    requests = lambda: [Request(row=i, prompt=p, max_new_tokens=n) for i, p in enumerate(prompts)]  # noqa: E731
    with step_rows() as rows:
        Decoder(graphs, len(prompts), k, "select", Stats(), on_commit=at_end, pipelined=False).generate(requests())
    with request_end_states() as ends:
        Decoder(graphs, len(prompts), k, "select", Stats()).generate(requests())
    different = differences(ends, lambda row, length: plain_ends[row])
    tolerant = sum(rows != plain_ends[row][2] for row, (_, _, _, rows) in ends.items() if row in plain_ends)
    ok = sorted(ends) == sorted(plain_ends) == list(range(len(prompts))) and not different
    checks.record(f"{label} states equal", ok, different or ok)
    print(f"{label}: each request's states at its end equal to the plain loop's ({len(ends) - tolerant} bitwise, "
          f"{tolerant} within 1e-5 where the last step ran other rows): {ok} {different or ''}")
    graphs.close()


def speed(model: Path, greedy, label: str, prompts: list, rounds: int, checks: Checks) -> list[list]:
    rows = []
    sessions = {k: ortspec.Session(model, provider="cuda", num_speculative_tokens=k) for k in KS}
    for batch in (1, 4, 16):
        def timed(session, pipelined):
            session.reset_stats()
            start = time.perf_counter()
            session.generate(prompts[:batch], max_new_tokens=128, stop_tokens=[], pipelined=pipelined)
            return batch * 128 / (time.perf_counter() - start), session.stats

        runs = [(greedy, None)] + [(sessions[k], p) for k in KS for p in (False, None)]
        for session, pipelined in runs:  # warm-up: graphs captured
            timed(session, pipelined)
        rates = {i: [] for i in range(len(runs))}
        steps = {}
        for round_ in range(rounds):
            for i in (range(len(runs)) if round_ % 2 == 0 else reversed(range(len(runs)))):
                rate, stats = timed(*runs[i])
                rates[i].append(rate)
                steps[i] = 1 + stats["accepted"] / max(1, stats["speculative_row_steps"])  # mean a + 1
        base = statistics.median(rates[0])
        checks.results[f"{label} batch {batch} tok/s"] = {"greedy": rates[0], **{
            f"k={k} {'pipelined' if p is None else 'plain'}": rates[i] for i, (_, p) in enumerate(runs) if i
            for k in [KS[(i - 1) // 2]]}}
        for j, k in enumerate(KS):
            plain, piped = statistics.median(rates[1 + 2 * j]), statistics.median(rates[2 + 2 * j])
            per_step = steps[2 + 2 * j]
            rows.append([label, batch, k, f"{base:.0f}", f"{plain:.0f}", f"{piped:.0f}", f"{per_step:.2f}",
                         f"{piped / plain:.2f}", f"{piped / base / per_step:.2f}"])
    for session in sessions.values():
        session.close()
    return rows
