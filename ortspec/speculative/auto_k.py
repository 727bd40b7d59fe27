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
  (rounded up to a power of two). Only steady steps count (the Decoder reports them): a step
  whose previous and next step ran the same k, so it costs what a long run of that k costs.
  A step between two k's is dearer (on CUDA the head then runs in a Run of its own, not inside
  the verify's graph: ``head_runs``; a k = 0 stretch ends with a catch-up), and so is a step
  that set a CUDA graph up (its first run or its capture: ``GraphSlots.setup_runs``).

So the chooser tries a k in runs of RUN_STEPS steps, whose inner steps are steady: until every
k has MIN_SAMPLES times at a row count it runs the k with the fewest; after that, every
PROBE_EVERY steps at that row count it runs another k again, each in turn, nearest to its
choice first, so that a k that became better (the text grew predictable, the KV window grew) is
found, a cost first measured on a cold or busy machine is measured again (k = 0 included: on a
CPU it measured 1.42 ms per step in the first call against 1.2 later, and a chooser that only
re-tried neighbours of k = 4 never saw it again), and an acceptance that was only measured at
small k is measured deeper. Only one probe slot in FAR_PROBES goes to every k in turn; the others
go to the ks estimated within NEAR x the best's tokens per second (none: no probe), so a k far
behind costs RUN_STEPS of every PROBE_EVERY * FAR_PROBES * K steps, not of every PROBE_EVERY * K.

Changing k costs steps. On CUDA the step that changes k verifies the drafts of the old k and
drafts for the new one, in two Runs in the plain loop, and the loop that ran a step ahead of the
GPU is drained before it and refilled after (``pipelined_speculation``). Measured on the H200
(20M fp16, batch 4, steps of ~1.4 ms): a probe, two changes and RUN_STEPS steps of another k,
cost 10-18 ms of a 62 ms call. So the chooser keeps the k of its last step unless the better
k's gain over the steps left (a static batch's tokens left over E(k); PROBE_EVERY steps in a
batcher) exceeds SWITCH_STEPS steps, and probes every PROBE_EVERY = 256 steps (it was 64: a
probe in every second call at batch 4).

k = 0 is plain greedy: that step does not run the MTP head. The Decoder keeps the target's
hidden states of such steps (``DeferredEntries``) and the head catches up over them in one run
when a later step speculates again, so a stretch of k = 0 costs what greedy costs.

The static batch's tail (``Tail``). In a generate call no request joins, so the slowest live
request sets the number of steps, and a larger k spreads the requests further (measured on the
H200, BENCHMARKS.md: k = 4 at batch 16 took 44 steps where the mean request needed 35). A
request's tokens per step t = a + 1 is a renewal process with mean mu_k = E(k) and variance
var_k, both from the per-depth acceptance: P(t > 0) = 1, P(t > i) = a1*...*ai (i = 1..k),
E[t] = sum_i P(t > i), E[t^2] = sum_i (2i+1) P(t > i). With N tokens left a request needs about
N/mu steps, variance N var/mu^3, so the slowest of B live requests needs about

    steps_k = N/mu + z_B sqrt(N var/mu^3)    z_B = Phi^-1((B - 0.375)/(B + 0.25))  (Blom; z_1 = 0)

and the chooser weighs k by the batch's tokens per step per request, N / steps_k, in place of
E(k) (k = 0: var = 0, so 1 either way). N is the largest budget left among live requests (stop
tokens make it an upper bound). A batcher's rows are refilled as requests finish: no tail there
(``tail=None``), E(k) as before.

The calls calibrate it (``record_call``). The model draws every request's tokens per step from
one pooled rate, but requests differ, and the slowest is the one with the lowest acceptance: on
the H200 (20M fp16) k = 4 took 44 steps at batch 4 and 16 where the model said 36, as many as
k = 3, and auto kept k = 4 at 0.98-1.02x greedy where k = 2 gave 1.08-1.10x; on the CPU at batch
4 k = 2 and k = 3 both took 26 steps. So a call that ran one k on CALL_K_SHARE of its steps
records its steps over the model's, per row bucket and k (a k no call ran takes the factor
between its measured neighbours, k = 0 being 1), and the tail's tokens per step are divided by
it; a call's first k is chosen once its requests are known (``choose(fresh=True)``), before any
draft, where changing k costs nothing. (Estimating each request's own acceptance was tried
instead: a few steps per request are noisy, the slowest of 16 noisy estimates read far too slow,
and auto fell to 0.77-0.90x; BENCHMARKS.md.) On the CPU, where a step runs only the live
requests, the tail's steps cost less than full ones, so the tail weighs a little more than it
costs there.

What the model leaves out: the MTP head's catch-up over the prompts. A prefill whose next step
is k = 0 leaves it for later (``DeferredEntries``), so an auto Session that runs greedy throughout
never pays it; one that speculates pays it at its first catch-up, outside every k's cost.

One chooser serves every call and batcher of a Session (thread-safe); k changes only which
rows the verify runs and how many drafts the head makes, so outputs stay those of greedy (on a
GPU in float16/bfloat16, exact mode keeps them independent of k; see the README).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import operator
import statistics
import threading

import numpy as np

MIN_SAMPLES = 3  # timed steps per (row count, k) before the chooser trusts its cost (a median of 3 outlasts one outlier)
WINDOW = 8  # step times kept per (row count, k); their median is the cost
RUN_STEPS = MIN_SAMPLES + 2  # a trial of one k: its first and last steps border another k, the rest are steady
PROBE_EVERY = 256  # steps between trials of another k than the chosen one (each k in turn, nearest first)
SWITCH_STEPS = 3.0  # what a change of k costs, in steps of the k it leaves (module docstring)
NEAR, FAR_PROBES = 0.8, 4  # a k slower than NEAR x the best's tokens/s is tried in one probe slot of FAR_PROBES
HALF_LIFE_ROW_STEPS = 256.0  # acceptance counts halve after this many row-steps
PRIOR_ROW_STEPS = 1.0  # pseudo row-steps at acceptance 0.5 per depth
CALL_K_SHARE = 0.75  # a call calibrates its k's tail when at least this share of its steps ran that k


@dataclasses.dataclass(frozen=True)
class Tail:
    """What a static batch (a generate call: no request joins) has left: ``live`` unfinished
    requests, the most of which needs ``tokens_left`` more tokens. choose weighs k by the
    slowest request's steps (the module docstring says how)."""

    live: int
    tokens_left: int

    @classmethod
    def of(cls, requests) -> "Tail":
        """From a generate call's requests (``requests.Request``): placeholders and done ones left out."""
        left = [r.max_new_tokens - r.output_length for r in requests if not r.done and not r.placeholder]
        return cls(len(left), max(left, default=0))


@functools.lru_cache(maxsize=256)
def expected_max_normal(n: int) -> float:
    """z_n: the expected largest of n standard normals, by Blom's approximation (z_1 = 0)."""
    return statistics.NormalDist().inv_cdf((n - 0.375) / (n + 0.25)) if n > 1 else 0.0


def tail_tokens_per_step(mean: float, variance: float, tail: Tail | None) -> float:
    """A static batch's tokens per step per request: N / (N/mu + z_B sqrt(N var/mu^3)), where
    each request's tokens per step have this mean and variance; ``mean`` where there is no tail."""
    if tail is None or tail.live <= 1 or tail.tokens_left <= 0:
        return mean
    n = tail.tokens_left
    steps = n / mean + expected_max_normal(tail.live) * math.sqrt(n * max(variance, 0.0) / mean ** 3)
    return n / steps


def row_bucket(rows: int) -> int:
    """The row count a step's cost is filed under: the next power of two."""
    return 1 << max(0, int(rows) - 1).bit_length()


class KChooser:
    """Chooses k per step (``choose``) from what ``record_time`` and ``record_accepts`` measured.
    choose runs inside every step, so it reads costs and expected tokens kept up to date by the
    records (a few microseconds), not recomputed from the samples."""

    def __init__(self, max_k: int) -> None:
        self.max_k = max_k
        self._lock = threading.Lock()
        self._times: dict[tuple[int, int], collections.deque] = {}  # (bucket, k) -> recent steady step seconds
        self._costs: dict[tuple[int, int], float] = {}  # (bucket, k) -> their median, once MIN_SAMPLES exist
        self._trials: dict[int, list[int]] = {}  # bucket -> the k of the trial running there, one per step left
        self._steps: dict[int, int] = {}  # bucket -> choices made there
        self._probes: dict[int, int] = {}  # bucket -> trials made there after every k was timed
        self._current: dict[int, int] = {}  # bucket -> the k chosen last there outside a trial
        self._tail_factor: dict[tuple[int, int], float] = {}  # (bucket, k) -> calls' steps / the model's (record_call)
        self._tail_factors: dict[int, list[float]] = {}  # bucket -> [K+1] per k, measured or in between: made from
        #                                                  _tail_factor by record_call, read by every choose
        # per depth i = 0..K (lists: K+1 numbers, updated every step; numpy costs more than the sums)
        self._tried = [0.0] * (max_k + 1)  # row-steps that tried draft i (decayed)
        self._kept = [0.0] * (max_k + 1)  # row-steps that accepted draft i (decayed)
        self._expected, self._variance = self._tokens_moments()  # [K+1] E(k), var(k): in step with the counts

    # -- measurements ----------------------------------------------------------------------
    def record_time(self, rows: int, k: int, seconds: float) -> None:
        """One steady step's seconds (the module docstring says which steps are)."""
        key = (row_bucket(rows), k)
        with self._lock:
            times = self._times.setdefault(key, collections.deque(maxlen=WINDOW))
            times.append(seconds)
            if len(times) >= MIN_SAMPLES:
                self._costs[key] = statistics.median(times)

    def record_accepts(self, accepted, k: int) -> None:
        """accepted [rows]: the accept lengths of one speculative step's live rows, of k drafts.
        A row with accept length a tried drafts 1..min(a+1, k) and kept drafts 1..a, so per depth
        i >= 1: tried by the rows with a >= i - 1 (i <= k), kept by the rows with a >= i."""
        lengths = [int(a) for a in accepted]
        if not lengths:
            return
        at_least = [0] * (self.max_k + 2)  # index i: rows with a >= i
        for a in lengths:
            at_least[min(a, self.max_k + 1)] += 1
        for i in range(self.max_k, -1, -1):
            at_least[i] += at_least[i + 1]
        decay = 0.5 ** (len(lengths) / HALF_LIFE_ROW_STEPS)
        with self._lock:
            for i in range(1, self.max_k + 1):
                self._tried[i] = self._tried[i] * decay + (at_least[i - 1] if i <= k else 0)
                self._kept[i] = self._kept[i] * decay + at_least[i]
            self._expected, self._variance = self._tokens_moments()

    # -- the model -------------------------------------------------------------------------
    def acceptance(self) -> np.ndarray:
        """[K] ai for i = 1..K: the rate draft i is accepted when drafts 1..i-1 were."""
        return np.array(self._rates())

    def _rates(self) -> list[float]:
        return [(self._kept[i] + 0.5 * PRIOR_ROW_STEPS) / (self._tried[i] + PRIOR_ROW_STEPS)
                for i in range(1, self.max_k + 1)]

    def _tokens_moments(self) -> tuple[list[float], list[float]]:
        """Per k, the mean and variance of a request's tokens per step t (t > i with probability
        a1*...*ai): E[t] = sum_i P(t > i), E[t^2] = sum_i (2i+1) P(t > i), i = 0..k."""
        beyond = list(itertools.accumulate(self._rates(), operator.mul, initial=1.0))  # [K+1] P(t > i)
        mean = list(itertools.accumulate(beyond))  # [K+1] index k: E[t] with k drafts
        square = itertools.accumulate((2 * i + 1) * p for i, p in enumerate(beyond))  # [K+1] E[t^2]
        return mean, [sq - m * m for sq, m in zip(square, mean)]

    def expected_tokens(self, k: int) -> float:
        """E(k): tokens a request gains per step with k drafts."""
        return self._expected[k]

    def tokens_variance(self, k: int) -> float:
        """var(k): the variance of the tokens a request gains per step with k drafts."""
        return self._variance[k]

    def batch_tokens(self, k: int, tail: Tail | None = None, bucket: int | None = None) -> float:
        """Tokens per step per request with k drafts: E(k), or in a static batch with this
        tail, N over the slowest request's expected steps, times the steps that calls of k at
        this row bucket took over the model's (``record_call``; 1 until one did)."""
        tokens = tail_tokens_per_step(self._expected[k], self._variance[k], tail)
        factors = self._tail_factors.get(bucket) if tail is not None and tail.live > 1 else None
        return tokens / factors[k] if factors else tokens

    def record_call(self, rows: int, steps_by_k, tail: Tail) -> None:
        """A static batch's call ended: steps_by_k [K+1] the steps it ran by k, tail its tail when
        its first step was chosen. Where one k >= 1 ran CALL_K_SHARE of them, the call's steps over
        what the model expected (N/E(k) and the spread, ``tail_tokens_per_step``) calibrate that
        k's tail at this row bucket, as a running mean over calls (each new call half the weight).
        Why: the model takes every request's tokens per step as draws of one pooled rate, but
        requests differ, and the slowest sets the steps: on the H200 (20M fp16, batch 16) k = 4
        took 44 steps as k = 3 did where the model said 36, and auto kept k = 4 at 0.98x greedy
        against k = 2's 1.08x. A k no call has run gets the factor in between its measured
        neighbours (k = 0: 1, a token a step), or the largest measured k's above it; when it then
        looks best it runs, and its call measures it."""
        total = sum(steps_by_k)
        k = max(range(1, len(steps_by_k)), key=lambda i: steps_by_k[i], default=0)
        if tail.live <= 1 or tail.tokens_left <= 0 or k == 0 or steps_by_k[k] < CALL_K_SHARE * total:
            return
        with self._lock:
            expected = tail.tokens_left / tail_tokens_per_step(self._expected[k], self._variance[k], tail)
            key = (row_bucket(rows), k)
            ratio, old = total / expected, self._tail_factor.get(key)
            self._tail_factor[key] = ratio if old is None else 0.5 * (old + ratio)
            measured = sorted({0: 1.0, **{j: f for (b, j), f in self._tail_factor.items() if b == key[0]}}.items())
            ks, factors = zip(*measured)  # np.interp holds the last measured factor beyond the largest k
            self._tail_factors[key[0]] = np.interp(range(self.max_k + 1), ks, factors).tolist()

    def cost(self, rows: int, k: int) -> float | None:
        """Median seconds of a step with k drafts at this row count; None until MIN_SAMPLES were timed."""
        return self._costs.get((row_bucket(rows), k))

    def choose(self, rows: int, tail: Tail | None = None, fresh: bool = False) -> int:
        """The k of the next step over this many rows (the module docstring says how); tail: a
        static batch's (``Tail``; None: a batcher, whose rows are refilled). fresh: the first
        step of a call, before any draft: changing k there costs nothing (no SWITCH_STEPS)."""
        bucket = row_bucket(rows)
        with self._lock:
            return self._next_k(bucket, tail, fresh)

    def _next_k(self, bucket: int, tail: Tail | None, fresh: bool = False) -> int:
        """(under the lock) choose's answer: a trial's k, else the best k (the last best kept
        unless switching pays, ``_worth_switching``; a trial's k is never kept: leaving it is part
        of the trial's cost), or every PROBE_EVERY steps a probe."""
        steps = self._steps[bucket] = self._steps.get(bucket, 0) + 1
        trial = self._trials.get(bucket)
        if trial:
            return trial.pop()
        costs = [self._costs.get((bucket, k)) for k in range(self.max_k + 1)]
        if None in costs:
            untimed = [k for k, c in enumerate(costs) if c is None]
            return self._start_trial(bucket, min(untimed, key=lambda k: len(self._times.get((bucket, k), ()))))
        rates = [self.batch_tokens(k, tail, bucket) / costs[k] for k in range(self.max_k + 1)]
        best = max(range(self.max_k + 1), key=lambda k: rates[k])
        current = best if fresh else self._current.get(bucket, best)  # the last choice that was not a trial's
        if not self._worth_switching(rates[best], rates[current], current, tail):
            best = current
        self._current[bucket] = best
        if steps % PROBE_EVERY:
            return best
        self._probes[bucket] = probe = self._probes.get(bucket, 0) + 1
        others = sorted((k for k in range(self.max_k + 1) if k != best), key=lambda k: (abs(k - best), k))
        if probe % FAR_PROBES:  # most probe slots go to a k within reach of the best, in turn
            near = [k for k in others if rates[k] >= NEAR * rates[best]]
            return self._start_trial(bucket, near[(probe - 1) % len(near)]) if near else best
        return self._start_trial(bucket, others[(probe // FAR_PROBES - 1) % len(others)])  # every k, in turn

    def _worth_switching(self, best_rate: float, current_rate: float, current: int, tail: Tail | None) -> bool:
        """Whether leaving the k of the last step for a better one gains more than the change
        costs, SWITCH_STEPS steps: over the steps left in a static batch (its tokens left over
        E(current)), or over PROBE_EVERY steps in a batcher."""
        if best_rate <= current_rate:
            return False
        steps_left = tail.tokens_left / self._expected[current] if tail is not None else PROBE_EVERY
        return (best_rate / current_rate - 1.0) * steps_left > SWITCH_STEPS

    def _start_trial(self, bucket: int, k: int) -> int:
        """(under the lock) RUN_STEPS steps of k from now: this one and RUN_STEPS - 1 more."""
        self._trials[bucket] = [k] * (RUN_STEPS - 1)
        return k

    def snapshot(self) -> dict:
        """What the chooser believes now (``Session.stats["auto_k"]``): acceptance per depth,
        expected tokens per k, and per row count the median step milliseconds per k."""
        with self._lock:
            times = {key: statistics.median(t) for key, t in self._times.items() if t}
            acceptance, expected = self.acceptance(), list(self._expected)
            factors = dict(self._tail_factor)
        buckets = sorted({b for b, _ in times})
        return {
            "acceptance_by_depth": [round(float(a), 4) for a in acceptance],
            "expected_tokens": [round(e, 3) for e in expected],
            "step_ms": {b: {k: round(times[(b, k)] * 1e3, 3) for k in range(self.max_k + 1) if (b, k) in times}
                        for b in buckets},
            "tail_factor": {b: {k: round(f, 3) for (bb, k), f in sorted(factors.items()) if bb == b}
                            for b in sorted({b for b, _ in factors})},
        }


class ScriptedK(KChooser):
    """Chooses k from a script (cycled) and measures like KChooser: the exactness checks (tests,
    tools/gpu.py greedy_loop and auto_loop) run chosen k sequences, long stretches of k = 0 among them."""

    def __init__(self, max_k: int, script) -> None:
        super().__init__(max_k)
        self.script = itertools.cycle(script)

    def choose(self, rows: int, tail: Tail | None = None, fresh: bool = False) -> int:
        return next(self.script)
