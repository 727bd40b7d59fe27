"""Auto k's step times from a loop one step ahead of the GPU (``pipelined``, ``pipelined_speculation``).

The plain loop times a step from before it starts to after its commit (``Decoder.step``). A
loop one step ahead cannot: step n+1 is enqueued before step n is read, so the GPU works on
both at once. In steady state the interval between two consecutive reads (step n-1's results,
then step n's) is what one step of the run's k costs, and that is what ``StepClock`` gives the
chooser (``auto_k.KChooser.record_time``). Left out:

- step 0 of a run: its interval holds the pipeline's fill (the whole of step 0 and the enqueue
  of step 1);
- a step whose interval or the one before it set a CUDA graph up (``GraphSlots.setup_runs``:
  a first run or capture waits for the GPU, which then has no step queued for the next interval);
- the time the loop spends suspended at its yield (the caller's: ``Decoder.step`` does not
  count it either).

One clock per run (a run has one k): the greedy loop's stretches of k = 0 (``auto_stretch``)
and the speculative loop's runs of one k >= 1 use it alike.
"""

from __future__ import annotations

import collections
import contextlib
import time


class StepClock:
    """Times the steps of one pipelined run of k drafts over ``rows`` rows for ``chooser``."""

    def __init__(self, chooser, slots, rows: int, k: int) -> None:
        self.chooser, self.slots, self.rows, self.k = chooser, slots, rows, k
        self._setups = collections.deque([slots.setup_runs], maxlen=3)  # at the start, then at each read
        self._last_read: float | None = None  # the clock at the last read, less the time suspended
        self._suspended = 0.0  # seconds spent at the loop's yield so far

    def read(self, n: int) -> None:
        """Step n's results were just read: its interval since step n-1's read goes to the chooser
        unless it is step 0 or a graph was set up since the read before the last."""
        now = time.perf_counter() - self._suspended
        self._setups.append(self.slots.setup_runs)
        if n >= 1 and self._setups[0] == self._setups[-1]:
            self.chooser.record_time(self.rows, self.k, now - self._last_read)
        self._last_read = now

    @contextlib.contextmanager
    def suspended(self):
        """Around the loop's yield: the caller's time is no step's."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._suspended += time.perf_counter() - start
