"""Auto k's stretches of k = 0 steps in the pipelined loop: what each step does beyond greedy.

With ``num_speculative_tokens="auto"`` a k = 0 step is a plain decode whose MTP-head entry waits
for the next speculative step (``deferred_entries``). Where the pipelined loop applies
(``pipelined.PipelinedGreedy``), a stretch of such steps runs there, the host a step ahead of
the GPU, so an auto Session that chose greedy costs what a greedy Session costs. Per step,
``AutoStretch``:

- keeps the step's MTP entries: its hidden rows [B, 1, H] reach the host a step late, like its
  tokens (a second ``streams.Readback``), and go to ``DeferredEntries`` with the tokens
  (x_{p+1}) and positions p;
- asks the chooser for the k of the next step before the loop enqueues it (``next_k``), telling
  it the batch's tail (``auto_k.Tail``: the loop runs generate calls, static batches); once it
  asks for drafts, the loop enqueues nothing more, reads the last step and ends the stretch,
  and the Decoder catches the head up over the entries and speculates;
- times the step for the chooser (``step_clock.StepClock``): with the host a step ahead, the
  interval between two consecutive token reads is what a k = 0 step costs in steady state.
"""

from __future__ import annotations

import numpy as np

from ..runtime.device_decode import DeviceDecode
from .auto_k import KChooser, Tail
from .deferred_entries import DeferredEntries
from .requests import Batch
from .step_clock import StepClock


class AutoStretch:
    """One stretch of k = 0 steps over ``batch`` (fixed rows): entries, choices, step times."""

    def __init__(self, chooser: KChooser, deferred: DeferredEntries, slots, batch: Batch) -> None:
        self.chooser, self.deferred, self.batch = chooser, deferred, batch
        self.clock = StepClock(chooser, slots, len(batch), 0)
        self.suspended = self.clock.suspended  # around the loop's yield: the caller's time is no step's

    def next_k(self) -> int:
        """The k of the step after the one just enqueued (0: the loop enqueues it)."""
        return self.chooser.choose(len(self.batch), Tail.of(self.batch.requests))

    def record_step(self, decode: DeviceDecode, n: int, tokens: np.ndarray, positions: np.ndarray) -> None:
        """After step n's tokens [B] were read: its hidden rows (read now, landed with them) and
        the tokens at positions [B] become deferred MTP entries; its interval goes to the chooser."""
        hidden = decode.hidden(n)  # [B, H]
        self.clock.read(n)
        self.deferred.add_host(self.batch.requests, self.batch.rows, hidden, decode.hidden_dtype, tokens, positions)
