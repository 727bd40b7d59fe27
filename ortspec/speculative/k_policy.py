"""How many drafts each step verifies: one policy object per Session, asked by the loop in one place.

The loop asks ``next_k(rows, tail, sampled=...)`` once per step, when it plans that step, for the drafts the
step's MTP head makes: the k of the step after it (a fused step drafts inside the verify's
graph, so the choice comes a step early). It tells the policy what every step did with
``record(step)``. ``FixedK`` answers its k; ``AutoK`` asks the measured chooser
(``auto_k.KChooser``: the k whose windows of steps delivered the most tokens per second) and
feeds it.

``record`` times a step only when it is steady: the same k ran before it and runs after it,
and no CUDA graph was set up while it ran (a first run or capture waits for the GPU), so its
time is what a long run of that k costs.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np

from .auto_k import KChooser, Tail


class StepRecord(NamedTuple):
    """What one step did, for the policy: its k, the next step's k, the rows it ran, the live
    rows' accept lengths, the tokens it emitted, its seconds (the loop's time since the last
    step was read), those seconds again where the step was steady (else None), and whether a
    CUDA graph was set up while it ran."""

    k: int
    next_k: int
    rows: int
    accepted: np.ndarray  # [live rows]
    tokens: int
    elapsed: float
    seconds: float | None
    setup: bool = False  # a CUDA graph was set up while it ran (its time is not a step's)


class FixedK:
    """Every step verifies k drafts (0: plain greedy)."""

    def __init__(self, k: int) -> None:
        self.max_k = self.k = k

    def next_k(self, rows: int, tail: Tail | None, fresh: bool = False, sampled: bool = False) -> int:
        return self.k

    def record(self, step: StepRecord) -> None:
        pass

    def end_call(self, rows: int, steps_by_k: list, tail: Tail) -> None:
        pass

    def snapshot(self) -> dict | None:
        return None


class KScript(FixedK):
    """Answers the k of a script in turn, cycled, and measures nothing (a warm-up's steps)."""

    def __init__(self, ks) -> None:
        super().__init__(max(ks))
        self.ks = list(ks)
        self._next = itertools.cycle(self.ks)

    def next_k(self, rows: int, tail: Tail | None, fresh: bool = False, sampled: bool = False) -> int:
        return next(self._next)

    @classmethod
    def warm_up(cls, k: int, auto: bool) -> "KScript":
        """Every step a Session of k may run: k itself; with auto k, each k in 0..k a few steps in
        a row and each switch to a neighbour, up and down (a switch runs the head in a Run of its
        own, a k = 0 stretch ends with a catch-up)."""
        if not auto:
            return cls([k])
        up = list(range(k + 1))
        return cls([j for j in up + up[-2:0:-1] for _ in range(3)])


class AutoK:
    """k in 0..K chosen per step by a ``KChooser`` shared by every call and batcher of a Session."""

    def __init__(self, chooser: KChooser) -> None:
        self.chooser, self.max_k = chooser, chooser.max_k

    def next_k(self, rows: int, tail: Tail | None, fresh: bool = False, sampled: bool = False) -> int:
        """rows: the rows the step runs; tail: a static batch's (a generate call's: its slowest
        request sets the steps); fresh: a call's first choice, before any draft, where changing k
        costs nothing; sampled: most of its live rows sample."""
        return self.chooser.choose(rows, tail, fresh=fresh, sampled=sampled)

    def record(self, step: StepRecord) -> None:
        if step.k > 0:
            self.chooser.record_accepts(step.accepted, step.k)
        if step.seconds is not None:
            self.chooser.record_time(step.rows, step.k, step.seconds)
        self.chooser.record_step(step.rows, len(step.accepted), step.tokens, step.elapsed, step.setup)

    def end_call(self, rows: int, steps_by_k: list, tail: Tail) -> None:
        """A generate call ended: its window closes (``KChooser.record_call``)."""
        self.chooser.record_call(rows, steps_by_k, tail)

    def snapshot(self) -> dict:
        return self.chooser.snapshot()


def policy_for(k: int, chooser: KChooser | None) -> FixedK | AutoK:
    """The policy of a Session of k (auto: the most drafts a step may verify, with its chooser)."""
    return AutoK(chooser) if chooser is not None else FixedK(k)
