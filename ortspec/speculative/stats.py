"""Counters of a call (``Stats``) and a Session's totals over every call (``StatsTotals``;
``Session.stats`` returns them as a dict).

Two units are counted, and each name says which:

- a **step** is one target forward over new tokens for the whole batch: a plain decode
  step (M=1) or a speculative step (propose, verify M=k+1, accept, commit);
- a **row-step** is one request taking part in one speculative step. A batch of 4 running
  10 speculative steps makes 10 steps and 40 row-steps; acceptance is counted per row-step.

Time is split into phases that never overlap (``timed`` refuses to nest them), so the phase
times add up to at most the wall time of the calls they were measured in.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time

PHASES = ("prefill", "decode", "propose", "verify", "commit")


class NestedPhaseError(RuntimeError):
    """A phase timer was started inside another: its time would be counted twice."""


@dataclasses.dataclass
class Stats:
    requests: int = 0
    """Requests prefilled (the placeholder rows that pad a CUDA batch bucket are not counted)."""
    prompt_tokens: int = 0
    """Prompt tokens of those requests."""
    generated_tokens: int = 0
    """Tokens returned to callers (the first token from prefill included; surplus tokens past
    max_new_tokens or a stop token, and placeholder rows, not)."""
    steps: int = 0
    """Steps: decode_steps + speculative_steps (one target forward over new tokens each)."""
    decode_steps: int = 0
    """Plain decode steps (M=1; in exact mode the fixed shape, one real token per row): every
    step of a greedy session; in a speculative session, the steps taken when fewer than k
    positions are left before max_length."""
    pipelined_steps: int = 0
    """Those of the decode steps that overlapped another on the device: enqueued before the step
    before them was read, or with the next one enqueued before they were read (the loop at depth 1,
    ``speculative/decoder.py``; CUDA's default). A step run past a stop token (its token dropped) is
    not counted."""
    pipelined_speculative_steps: int = 0
    """Those of the speculative steps that overlapped another on the device (as pipelined_steps;
    fused steps of a run of one k). A step run past the end of every request (its tokens dropped)
    is not counted."""
    speculative_steps: int = 0
    """Speculative steps (propose, verify, accept, commit), each counted once for the batch."""
    fused_verify_steps: int = 0
    """Speculative steps that ran the MTP head inside the verify's graph (``verify_mtp_k{k}``:
    one Run per step; ``speculative.step_kinds``); the others ran it in a Run of its own."""
    speculative_row_steps: int = 0
    """Row-steps: the unfinished requests of each speculative step, summed over the steps
    (= sum(accept_histogram))."""
    drafted: int = 0
    """Drafts proposed: k per row-step."""
    accepted: int = 0
    """Drafts accepted (each matched the target's argmax): sum over row-steps of a."""
    accept_histogram: list = dataclasses.field(default_factory=list)
    """accept_histogram[a] = row-steps that accepted exactly a drafts (a = 0..k)."""
    steps_by_k: list = dataclasses.field(default_factory=list)
    """steps_by_k[k] = steps that verified k drafts (k = 0: plain decode steps); with
    num_speculative_tokens="auto" the k the Session chose."""
    position_mismatches: int = 0
    """Row-steps whose accept length derived from positions disagreed with the acceptance rule
    (always 0 unless there is a bug; positions win)."""
    readvance_forwards: int = 0
    """Target forwards the readvance commit re-ran (M=1; in exact mode the fixed shape): per
    speculative step, 1 + the longest accepted prefix among the rows that rejected a draft;
    none when every row accepted all."""
    seconds: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    """Wall seconds per phase, the phases disjoint. prefill: target and MTP head over prompts.
    decode: plain decode steps (with the MTP head's entry for the new token when speculating).
    propose: collecting the drafts (the MTP head drafted them in the previous commit's graph run,
    so this is near zero). verify: the target over [x_T, d1..dk] (and the readvance snapshot;
    in a fused step also the MTP head's catch-up and drafts, which run in the verify's graph).
    commit: states to the accepted length (readvance re-runs included) and the MTP head's
    catch-up, which also drafts the next step's d1..dk (a fused step enqueues its commit with its
    Run: counted in verify)."""

    _running: str | None = dataclasses.field(default=None, repr=False, compare=False)

    def timed(self, phase: str) -> "PhaseTimer":
        """``with stats.timed(phase):`` adds the time of the block to ``seconds[phase]``; refuses to
        run inside another phase."""
        return PhaseTimer(self, phase)

    def record_decode_step(self) -> None:
        self.steps += 1
        self.decode_steps += 1
        _count(self.steps_by_k, 0, 1)

    def record_speculative_step(self, accepted, k: int, fused: bool = False) -> None:
        """One speculative step; ``accepted`` (numpy int64 [rows]) holds the accept lengths of its
        unfinished rows; fused: the MTP head ran inside the verify's graph."""
        accepted = accepted.tolist()  # as ints: for a step's few rows, cheaper than numpy scalars
        _count(self.accept_histogram, k, 0)
        for a in accepted:
            self.accept_histogram[a] += 1
        _count(self.steps_by_k, k, 1)
        self.steps += 1
        self.speculative_steps += 1
        self.fused_verify_steps += fused
        self.speculative_row_steps += len(accepted)
        self.drafted += k * len(accepted)
        self.accepted += sum(accepted)

    def clear(self) -> None:
        """Every counter back to zero, in place (the loop's step kinds keep a reference to these)."""
        for name in _COUNTERS:
            setattr(self, name, 0)
        for name, factory in _CONTAINERS:
            setattr(self, name, factory())

    def merge(self, other: "Stats") -> None:
        """Adds another call's counters to these (every int counter, the histogram, the phase times)."""
        for name in _COUNTERS:
            if value := getattr(other, name):
                setattr(self, name, getattr(self, name) + value)
        for mine, theirs in ((self.accept_histogram, other.accept_histogram), (self.steps_by_k, other.steps_by_k)):
            for index, count in enumerate(theirs):
                _count(mine, index, count)
        for phase, seconds in other.seconds.items():
            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0.0 before any draft)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        """Tokens a request gains per speculative step it takes part in, (accepted + row-steps) /
        row-steps: the accepted drafts plus the bonus token. 1.0 when only decode steps ran."""
        if self.speculative_row_steps:
            return (self.accepted + self.speculative_row_steps) / self.speculative_row_steps
        return 1.0 if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        """generated_tokens over the summed phase seconds (prefill included): the rate inside the
        decoder, without the caller's own work (tokenizing, checking prompts)."""
        busy = sum(self.seconds.values())
        return self.generated_tokens / busy if busy else 0.0

    def as_dict(self) -> dict:
        """Every counter (copies, so the dict does not change with later steps) and the derived rates."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}
        d["accept_histogram"], d["steps_by_k"] = list(self.accept_histogram), list(self.steps_by_k)
        d["seconds"] = dict(self.seconds)
        for name in DERIVED:
            d[name] = getattr(self, name)
        return d


class PhaseTimer:
    """The block of ``Stats.timed`` (a class, not a generator: each step enters a few of them)."""

    __slots__ = ("stats", "phase", "start")

    def __init__(self, stats: Stats, phase: str) -> None:
        self.stats, self.phase = stats, phase

    def __enter__(self) -> None:
        stats = self.stats
        if stats._running is not None:
            raise NestedPhaseError(f"phase {self.phase!r} started inside phase {stats._running!r}; phases "
                                   "must not nest, or their time is counted twice")
        stats._running, self.start = self.phase, time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.stats.seconds[self.phase] += time.perf_counter() - self.start
        self.stats._running = None


DERIVED = ("acceptance_rate", "mean_tokens_per_step", "tokens_per_second")
_PUBLIC = [f for f in dataclasses.fields(Stats) if not f.name.startswith("_")]  # once: merge / clear run every call
_COUNTERS = tuple(f.name for f in _PUBLIC if f.default is not dataclasses.MISSING)  # the int counters (default 0)
_CONTAINERS = tuple((f.name, f.default_factory) for f in _PUBLIC if f.default is dataclasses.MISSING)


def _count(histogram: list, index: int, n: int) -> None:
    """histogram[index] += n, growing the list with zeros as needed."""
    if len(histogram) <= index:
        histogram.extend([0] * (index + 1 - len(histogram)))
    histogram[index] += n


class StatsTotals:
    """A Session's counters over all its calls. Each call (a generate, a batcher's step) counts
    into its own Stats and adds them here when it ends, under a lock: calls in several threads
    neither race on a counter nor see each other's half-counted steps."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = Stats()

    def add(self, stats: Stats) -> None:
        """Adds a call's counters and zeroes them (a batcher's, counted again from its next call)."""
        with self._lock:
            self._stats.merge(stats)
        stats.clear()

    def snapshot(self) -> Stats:
        with self._lock:
            return copy.deepcopy(self._stats)

    def reset(self) -> None:
        with self._lock:
            self._stats = Stats()
