"""``num_speculative_tokens="auto"``: the k that delivered the most tokens per second, measured.

A model of E(k) (the tokens a step gains) over cost(k) is easy to write and hard to trust: the
slowest request of a static batch sets its steps, switching k drains the loop, a verify costs
what the GPU's kernels make of it, and a model tuned on one set of prompts misjudged another
(BENCHMARKS.md, "Auto k"). So ``KChooser`` measures what each k delivers and keeps the best:

- a **window** is a stretch of steps of one k: a whole generate call (a static batch: its tail
  and its switching costs are in its time), or WINDOW_STEPS steps of a batcher, fewer where they
  take longer than WINDOW_SECONDS (a CPU step over many rows takes 10-20 ms: 64 of them, one
  window per k, were a short run's whole exploration) (rows join and leave: its reward is tokens
  per live row-step over seconds per row-step run, so a window is not judged by how many
  requests happened to be running);
- a window that set a CUDA graph up is not counted (it timed the capture), nor a k's first at a
  key (its graphs' first runs allocate and initialise: a batcher's such window lasts
  MIN_WINDOW_STEPS steps) unless a warm-up ran every k at its rows already (on CUDA every batch
  bucket; on the CPU one row, where a first run at 8 rows measured 20-26 ms a step against 13-17
  ms warm);
- per key (static or not; the rows a step runs, bucketed; whether most live rows sample, whose
  drafts are accepted less often) the chooser hill-climbs over k: it starts at k = 1, measures
  the neighbours of the best k, measures the best and a neighbour within CLOSE of it again until
  each has CONFIRM windows (one window is noise), moves to one only when its median reward over
  its last SAMPLES windows beats the best's by HYSTERESIS, and every PROBE_EVERY windows measures
  a neighbour again (the text, the batch or the machine may have changed);
- tokens per second is the reward: what the caller gets, whatever made it so.

It also keeps what the steps showed (acceptance per draft depth, steady step times per k) for
``Session.stats["auto_k"]``. One chooser serves every call and batcher of a Session
(thread-safe; each thread's window is its own); k changes only which rows the verify runs and
how many drafts the head makes, so outputs stay greedy's.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import statistics
import threading

import numpy as np

WINDOW_STEPS = 64  # a batcher's window: steps of one k between choices
WINDOW_SECONDS = 0.25  # ... or fewer steps, once they took this long
MIN_WINDOW_STEPS = 4  # a shorter window (a call of a few tokens) measures nothing
SAMPLES = 3  # rewards kept per k; their median is its estimate
HYSTERESIS = 1.02  # another k must beat the best's estimate by 2% to take its place
PROBE_EVERY = 16  # windows between re-measurements of a neighbour of the best
CONFIRM, CLOSE = 2, 0.9  # the best and a neighbour within CLOSE of it are measured CONFIRM times before it settles
HALF_LIFE_ROW_STEPS = 256.0  # acceptance counts halve after this many row-steps (the snapshot's)
STEP_TIMES = 8  # steady step times kept per (rows bucket, k) for the snapshot


@dataclasses.dataclass(frozen=True)
class Tail:
    """What a static batch (a generate call: no request joins) has left: ``live`` unfinished
    requests, the most of which needs ``tokens_left`` more tokens. Its presence marks a static
    batch, whose windows are whole calls."""

    live: int
    tokens_left: int

    @classmethod
    def of(cls, requests) -> "Tail":
        """From a generate call's requests (``requests.Request``): placeholders and done ones left out."""
        left = [r.max_new_tokens - r.output_length for r in requests if not r.done and not r.placeholder]
        return cls(len(left), max(left, default=0))


def row_bucket(rows: int) -> int:
    """The rows a measurement is filed under: the next power of two."""
    return 1 << max(0, int(rows) - 1).bit_length()


@dataclasses.dataclass
class Window:
    """Steps of one k since the window opened."""

    key: tuple[bool, int, bool]  # (static, rows bucket, sampled)
    k: int
    steps: int = 0
    tokens: int = 0
    live_row_steps: int = 0
    run_row_steps: int = 0
    seconds: float = 0.0
    setup: bool = False  # a CUDA graph was set up in it: its time is not its k's
    warming: bool = False  # its k's first window at its key: it runs the first runs and measures nothing

    def full(self) -> bool:
        """A batcher's window has its steps: WINDOW_STEPS, or WINDOW_SECONDS' worth; a warming one
        MIN_WINDOW_STEPS (first runs are a step or two: the rest would be a k's time unmeasured)."""
        if self.warming:
            return self.steps >= MIN_WINDOW_STEPS
        return self.steps >= WINDOW_STEPS or (self.seconds >= WINDOW_SECONDS and self.steps >= MIN_WINDOW_STEPS)

    def reward(self) -> float | None:
        """Tokens per second (static); per live row-step over seconds per row-step run (a batcher)."""
        if self.steps < MIN_WINDOW_STEPS or self.seconds <= 0 or not self.live_row_steps or self.setup:
            return None
        if self.key[0]:
            return self.tokens / self.seconds
        return (self.tokens / self.live_row_steps) / (self.seconds / self.run_row_steps)


class Arms:
    """The rewards of each k for one key, and the k the hill climb stands on."""

    START = 1  # where the climb starts

    def __init__(self, max_k: int, warm: bool = False) -> None:
        self.max_k = max_k
        self.best = min(self.START, max_k)
        self.rewards = {k: collections.deque(maxlen=SAMPLES) for k in range(max_k + 1)}
        self.windows = 0
        # the k whose graphs have run here (a k's first window is not counted): all after a warm-up
        self.warm: set[int] = set(range(max_k + 1)) if warm else set()
        self._probe = itertools.cycle((1, -1))

    def estimate(self, k: int) -> float | None:
        return statistics.median(self.rewards[k]) if self.rewards[k] else None

    def next(self) -> int:
        """The k of the next window: an unmeasured neighbour of the best, every PROBE_EVERY windows
        a neighbour again, else the best."""
        self.windows += 1
        if not self.rewards[self.best]:
            return self.best  # the climb starts where it stands, and warms each k up before it counts
        neighbours = [k for k in (self.best + 1, self.best - 1) if 0 <= k <= self.max_k]
        unmeasured = [k for k in neighbours if not self.rewards[k]]  # a k's warm-up window, then its first
        if unmeasured:
            return unmeasured[0]
        best = self.estimate(self.best)
        unsure = [k for k in [self.best, *neighbours] if len(self.rewards[k]) < CONFIRM  # one window is noise:
                  and self.estimate(k) >= CLOSE * best]  # a close race is measured again before it settles
        if unsure:
            return unsure[0]
        if self.windows % PROBE_EVERY == 0 and neighbours:
            step = next(self._probe)
            return self.best + step if self.best + step in neighbours else neighbours[0]
        return self.best

    def add(self, k: int, reward: float) -> None:
        self.rewards[k].append(reward)
        estimates = {j: self.estimate(j) for j in self.rewards if self.rewards[j]}
        champion = max(estimates, key=estimates.get)
        best = estimates.get(self.best)
        if best is None or estimates[champion] > HYSTERESIS * best:
            self.best = champion


class KChooser:
    """Chooses k per step (``choose``) from the windows' measured rewards (module docstring)."""

    def __init__(self, max_k: int) -> None:
        self.max_k = max_k
        self._lock = threading.Lock()
        self._arms: dict[tuple[bool, int, bool], Arms] = {}
        self._local = threading.local()  # .window: this thread's open window
        self._tried = [0.0] * (max_k + 1)  # row-steps that tried draft i (decayed)
        self._kept = [0.0] * (max_k + 1)  # row-steps that accepted draft i (decayed)
        self._times: dict[tuple[int, int], collections.deque] = {}  # (bucket, k) -> steady step seconds
        self._warm_buckets: set[int] | None = set()  # rows buckets a warm-up ran every k at (None: all)

    # -- choosing ----------------------------------------------------------------------------
    def choose(self, rows: int, tail: Tail | None = None, fresh: bool = False, sampled: bool = False) -> int:
        """The k of the next step over this many rows (the rows it runs); tail: a static batch's
        (None: a batcher); fresh: a call's first choice (a static window opens); sampled: most of
        its live rows sample."""
        key = (tail is not None, row_bucket(rows), sampled)
        window = self.open_window
        if window is not None and window.key[0] and key[0] and not fresh:
            return window.k  # a call's window lasts the call
        if window is None or fresh or window.key != key or window.full():
            if window is not None and not window.key[0]:
                self._close(window)
            with self._lock:
                arms = self._arms_of(key)
                k = arms.next()
                warming = not key[0] and k not in arms.warm
            window = self._local.window = Window(key, k, warming=warming)
        return window.k

    @property
    def open_window(self) -> Window | None:
        """This thread's open window (None before its first choice and after a call's end)."""
        return getattr(self._local, "window", None)

    def _arms_of(self, key) -> Arms:
        if key not in self._arms:
            self._arms[key] = Arms(self.max_k, warm=self._warm_buckets is None or key[1] in self._warm_buckets)
        return self._arms[key]

    def warmed_up(self, rows: set[int] | None = None) -> None:
        """Every k's graphs have run (``Batcher.warm_up``) at these rows (None: at every row count):
        from now on a k's first window at a key of those rows counts, so a server's climb measures
        instead of warming each k up again."""
        with self._lock:
            buckets = None if rows is None else {row_bucket(n) for n in rows}
            self._warm_buckets = None if buckets is None or self._warm_buckets is None else self._warm_buckets | buckets
            for key, arms in self._arms.items():
                if buckets is None or key[1] in buckets:
                    arms.warm.update(range(self.max_k + 1))

    def _close(self, window: Window) -> None:
        reward = window.reward()
        if reward is not None:
            with self._lock:
                arms = self._arms_of(window.key)
                if window.k in arms.warm:
                    arms.add(window.k, reward)
                arms.warm.add(window.k)  # a k's first window here warms its graphs up (first runs allocate)

    # -- measurements ------------------------------------------------------------------------
    def record_step(self, rows_run: int, live: int, tokens: int, seconds: float, setup: bool = False) -> None:
        """One step of the open window: the rows it ran, the live ones, the tokens it emitted, its
        seconds (the loop's time since the last step was read), and whether a CUDA graph was set
        up meanwhile (such a window measures the capture, not k)."""
        window = self.open_window
        if window is not None:
            window.setup |= setup
            window.steps += 1
            window.tokens += tokens
            window.live_row_steps += live
            window.run_row_steps += rows_run
            window.seconds += seconds

    def record_call(self, rows: int, steps_by_k, tail: Tail) -> None:
        """A generate call ended: its window closes with the call's tokens per second."""
        window = self.open_window
        if window is not None and window.key[0]:
            self._close(window)
            self._local.window = None

    def record_time(self, rows: int, k: int, seconds: float) -> None:
        """One steady step's seconds (for the snapshot)."""
        with self._lock:
            self._times.setdefault((row_bucket(rows), k), collections.deque(maxlen=STEP_TIMES)).append(seconds)

    def record_accepts(self, accepted, k: int) -> None:
        """accepted [rows]: a speculative step's live rows' accept lengths, of k drafts. A row with
        accept length a tried drafts 1..min(a+1, k) and kept drafts 1..a (for the snapshot)."""
        lengths = np.asarray(accepted, np.int64)
        if not lengths.size:
            return
        depth = np.arange(1, self.max_k + 1)
        tried = ((depth[None] <= np.minimum(lengths + 1, k)[:, None]) & (depth[None] <= k)).sum(0)
        kept = (depth[None] <= lengths[:, None]).sum(0)
        decay = 0.5 ** (len(lengths) / HALF_LIFE_ROW_STEPS)
        with self._lock:
            for i in range(1, self.max_k + 1):
                self._tried[i] = self._tried[i] * decay + float(tried[i - 1])
                self._kept[i] = self._kept[i] * decay + float(kept[i - 1])

    def acceptance(self) -> np.ndarray:
        """[K] the rate draft i was accepted where drafts 1..i-1 were (0.5 before any was tried)."""
        return np.array([(self._kept[i] + 0.5) / (self._tried[i] + 1.0) for i in range(1, self.max_k + 1)])

    def snapshot(self) -> dict:
        """What the chooser measured (``Session.stats["auto_k"]``): acceptance per depth, expected
        tokens per step per k from it, the median steady step milliseconds per rows bucket and k,
        and per window key the best k and each k's median reward with its sample count."""
        with self._lock:
            acceptance = self.acceptance()
            times = {key: statistics.median(t) for key, t in self._times.items() if t}
            arms = {f"{'call' if static else 'batcher'} rows {bucket}{' sampled' if sampled else ''}": {
                "best": arm.best, "windows": arm.windows,
                "reward": {k: [round(arm.estimate(k), 3), len(arm.rewards[k])] for k in arm.rewards if arm.rewards[k]}}
                for (static, bucket, sampled), arm in sorted(self._arms.items())}
        expected = np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(acceptance))])
        buckets = sorted({b for b, _ in times})
        return {
            "acceptance_by_depth": [round(float(a), 4) for a in acceptance],
            "expected_tokens": [round(float(e), 3) for e in expected],
            "step_ms": {b: {k: round(times[(b, k)] * 1e3, 3) for k in range(self.max_k + 1) if (b, k) in times}
                        for b in buckets},
            "windows": arms,
        }


class ScriptedK(KChooser):
    """Chooses k from a script (cycled) and measures like KChooser: the exactness checks (tests,
    tools/gpu.py greedy_loop and auto_loop) run chosen k sequences, long stretches of k = 0 among them."""

    def __init__(self, max_k: int, script) -> None:
        super().__init__(max_k)
        self.script = itertools.cycle(script)

    def choose(self, rows: int, tail: Tail | None = None, fresh: bool = False, sampled: bool = False) -> int:
        return next(self.script)
