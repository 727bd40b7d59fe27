"""``num_speculative_tokens="auto"``: the k of each step, chosen from measured step times and acceptance.

How it decides. A step with k drafts yields each request on average

    E(k) = 1 + a1 + a1*a2 + ... + a1*a2*...*ak       tokens  (E(0) = 1: a plain decode)

where ai is the rate at which draft i is accepted when drafts 1..i-1 were, and it takes
cost(rows, k) seconds. The chooser takes the k in 0..K with the most tokens per second,
E(k) / cost(rows, k). Both are measured while generating:

- ai from every speculative row-step's accept length: a row that accepted a of k drafts tried
  drafts 1..min(a+1, k) and had drafts 1..a accepted. The counts decay (half-life
  HALF_LIFE_ROW_STEPS row-steps), so recent text weighs most; a prior of PRIOR_ROW_STEPS
  row-steps at rate 0.5 keeps an unseen depth from reading 0 or 1.
- cost(rows, k) as the median of the last WINDOW step times of that k at that many rows
  (rounded up to a power of two). Left out: the first step of each (warm-up: allocations), any
  step that set a CUDA graph up (its first run or its capture: ``GraphSlots.setup_runs``; the
  head's catch-up graph has a slot per verify width and draft count, so captures keep coming
  for a while), and the catch-up that ends a stretch of k = 0 (a switching cost, not a step's).

Until every k has MIN_SAMPLES times at a row count, the chooser tries the k with the fewest.
After that, every PROBE_EVERY steps at that row count it times a neighbour of its choice again
(k-1 and k+1 in turn), so that a k that became better (the text grew predictable, the KV window
grew) is found, and an acceptance that was only measured at small k is measured deeper.

k = 0 is plain greedy: that step does not run the MTP head. The Decoder keeps the target's
hidden states of such steps (``DeferredEntries``) and the head catches up over them in one run
when a later step speculates again, so a stretch of k = 0 costs what greedy costs. Where greedy
runs a step ahead of the GPU, so does such a stretch (``auto_stretch``); its steps' times are then
the intervals between token reads, a stretch's first step left out (the pipeline filling).

One chooser serves every call and batcher of a Session (thread-safe); k changes only which
rows the verify runs and how many drafts the head makes, so outputs stay those of greedy (on a
GPU in float16/bfloat16, exact mode keeps them independent of k; see the README).
"""

from __future__ import annotations

import collections
import itertools
import statistics
import threading

import numpy as np

MIN_SAMPLES = 3  # timed steps per (row count, k) before the chooser trusts its cost (a median of 3 outlasts one outlier)
WINDOW = 8  # step times kept per (row count, k); their median is the cost
PROBE_EVERY = 32  # steps between re-timings of a neighbour of the chosen k
HALF_LIFE_ROW_STEPS = 256.0  # acceptance counts halve after this many row-steps
PRIOR_ROW_STEPS = 1.0  # pseudo row-steps at acceptance 0.5 per depth


def row_bucket(rows: int) -> int:
    """The row count a step's cost is filed under: the next power of two."""
    return 1 << max(0, int(rows) - 1).bit_length()


class KChooser:
    """Chooses k per step (``choose``) from what ``record_time`` and ``record_accepts`` measured."""

    def __init__(self, max_k: int) -> None:
        self.max_k = max_k
        self._lock = threading.Lock()
        self._times: dict[tuple[int, int], collections.deque] = {}  # (bucket, k) -> recent step seconds
        self._warmed: set[tuple[int, int]] = set()  # (bucket, k) whose first step was left out
        self._steps: dict[int, int] = {}  # bucket -> choices made there
        self._probes: dict[int, int] = {}  # bucket -> re-timings made there (odd: k+1 next, even: k-1)
        self._tried = np.zeros(max_k + 1)  # [K+1], index i: row-steps that tried draft i (decayed)
        self._kept = np.zeros(max_k + 1)  # [K+1], index i: row-steps that accepted draft i (decayed)
        self._expected: np.ndarray | None = None  # [K+1] E(k), until the next record_accepts

    # -- measurements ----------------------------------------------------------------------
    def record_time(self, rows: int, k: int, seconds: float) -> None:
        key = (row_bucket(rows), k)
        with self._lock:
            if key not in self._warmed:
                self._warmed.add(key)
                return
            self._times.setdefault(key, collections.deque(maxlen=WINDOW)).append(seconds)

    def record_accepts(self, accepted: np.ndarray, k: int) -> None:
        """accepted [rows]: the accept lengths of one speculative step's live rows, of k drafts."""
        accepted = np.asarray(accepted, np.int64)
        if not len(accepted):
            return
        depth = np.arange(self.max_k + 1)  # [K+1]
        tried = (depth[None, :] >= 1) & (depth[None, :] <= np.minimum(accepted + 1, k)[:, None])  # [rows, K+1]
        kept = (depth[None, :] >= 1) & (depth[None, :] <= accepted[:, None])
        decay = 0.5 ** (len(accepted) / HALF_LIFE_ROW_STEPS)
        with self._lock:
            self._tried = self._tried * decay + tried.sum(0)
            self._kept = self._kept * decay + kept.sum(0)
            self._expected = None

    # -- the model -------------------------------------------------------------------------
    def acceptance(self) -> np.ndarray:
        """[K] ai for i = 1..K: the rate draft i is accepted when drafts 1..i-1 were."""
        with self._lock:
            return self._acceptance()

    def _acceptance(self) -> np.ndarray:  # (under the lock)
        return ((self._kept + 0.5 * PRIOR_ROW_STEPS) / (self._tried + PRIOR_ROW_STEPS))[1:]

    def expected_tokens(self, k: int) -> float:
        """E(k): tokens a request gains per step with k drafts."""
        return float(self.expected_tokens_by_k()[k])

    def expected_tokens_by_k(self) -> np.ndarray:
        """[K+1] E(k) for k = 0..K, kept until the acceptance changes (``choose`` runs every step,
        and a stretch of k = 0 steps records no acceptance)."""
        with self._lock:
            if self._expected is None:
                self._expected = 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(self._acceptance()))])
                self._expected.flags.writeable = False  # shared by every caller until replaced
            return self._expected

    def cost(self, rows: int, k: int) -> float | None:
        """Median seconds of a step with k drafts at this row count; None until MIN_SAMPLES were timed."""
        return self._costs(row_bucket(rows))[k]

    def _costs(self, bucket: int) -> list[float | None]:
        """[K+1] cost of each k at this row bucket, read under one lock."""
        with self._lock:
            times = [self._times.get((bucket, k)) for k in range(self.max_k + 1)]
            return [statistics.median(t) if t and len(t) >= MIN_SAMPLES else None for t in times]

    def choose(self, rows: int) -> int:
        """The k of the next step over this many rows (the module docstring says how)."""
        bucket = row_bucket(rows)
        costs = self._costs(bucket)
        untimed = [k for k, c in enumerate(costs) if c is None]
        with self._lock:
            self._steps[bucket] = self._steps.get(bucket, 0) + 1
            if untimed:
                return min(untimed, key=lambda k: len(self._times.get((bucket, k), ())) + ((bucket, k) in self._warmed))
            probe = self._steps[bucket] % PROBE_EVERY == 0
            if probe:
                self._probes[bucket] = self._probes.get(bucket, 0) + 1
        tokens = self.expected_tokens_by_k()  # [K+1]
        best = max(range(self.max_k + 1), key=lambda k: tokens[k] / costs[k])
        if probe:
            step = 1 if self._probes[bucket] % 2 else -1
            neighbour = best + step if 0 <= best + step <= self.max_k else best - step
            return min(max(neighbour, 0), self.max_k)
        return best

    def snapshot(self) -> dict:
        """What the chooser believes now (``Session.stats["auto_k"]``): acceptance per depth,
        expected tokens per k, and per row count the median step milliseconds per k."""
        with self._lock:
            times = {key: statistics.median(t) for key, t in self._times.items() if t}
        buckets = sorted({b for b, _ in times})
        return {
            "acceptance_by_depth": [round(float(a), 4) for a in self.acceptance()],
            "expected_tokens": [round(float(e), 3) for e in self.expected_tokens_by_k()],
            "step_ms": {b: {k: round(times[(b, k)] * 1e3, 3) for k in range(self.max_k + 1) if (b, k) in times}
                        for b in buckets},
        }


class ScriptedK(KChooser):
    """Chooses k from a script (cycled) and measures like KChooser: the exactness checks (tests,
    tools/gpu.py greedy_loop) run chosen k sequences, long stretches of k = 0 among them."""

    def __init__(self, max_k: int, script) -> None:
        super().__init__(max_k)
        self.script = itertools.cycle(script)

    def choose(self, rows: int) -> int:
        return next(self.script)
