"""Counters of a call (``Stats``) and a Session's totals over every call (``StatsTotals``;
``Session.stats`` returns them as a dict)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
import time

_SUMMED = ("requests", "prompt_tokens", "generated_tokens", "steps", "speculative_steps", "drafted", "accepted",
           "position_mismatches", "readvance_tokens")


@dataclasses.dataclass
class Stats:
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0  # decode or speculative steps (one per target forward over new tokens)
    speculative_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    accept_histogram: list = dataclasses.field(default_factory=list)  # [a] -> row-steps that accepted a drafts
    position_mismatches: int = 0  # accept length from positions disagreed with the acceptance rule
    readvance_tokens: int = 0  # tokens re-run by the readvance commit
    seconds: dict = dataclasses.field(default_factory=lambda: {
        "prefill": 0.0, "decode": 0.0, "propose": 0.0, "verify": 0.0, "commit": 0.0})

    @contextlib.contextmanager
    def timed(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    def record_accepts(self, accepted, k: int) -> None:
        if len(self.accept_histogram) < k + 1:
            self.accept_histogram.extend([0] * (k + 1 - len(self.accept_histogram)))
        for a in accepted:
            self.accept_histogram[int(a)] += 1
        self.speculative_steps += len(accepted)
        self.drafted += k * len(accepted)
        self.accepted += int(sum(accepted))

    def merge(self, other: "Stats") -> None:
        """Adds another call's counters to these."""
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if len(self.accept_histogram) < len(other.accept_histogram):
            self.accept_histogram.extend([0] * (len(other.accept_histogram) - len(self.accept_histogram)))
        for a, rows in enumerate(other.accept_histogram):
            self.accept_histogram[a] += rows
        for phase, seconds in other.seconds.items():
            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        rows = sum(self.accept_histogram)
        d["acceptance_rate"] = self.accepted / self.drafted if self.drafted else 0.0
        d["mean_tokens_per_step"] = (self.accepted + rows) / rows if rows else (1.0 if self.steps else 0.0)
        busy = sum(self.seconds.values())
        d["tokens_per_second"] = self.generated_tokens / busy if busy else 0.0
        return d


class StatsTotals:
    """A Session's counters over all its calls. Each call (a generate, a batcher's step) counts
    into its own Stats and adds them here when it ends, under a lock: calls in several threads
    neither race on a counter nor see each other's half-counted steps."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = Stats()

    def add(self, stats: Stats) -> None:
        with self._lock:
            self._stats.merge(stats)

    def snapshot(self) -> Stats:
        with self._lock:
            return copy.deepcopy(self._stats)

    def reset(self) -> None:
        with self._lock:
            self._stats = Stats()
