"""The kinds of step the loop runs, and which one a step is (``StepKinds.choose``).

Every kind answers the same verbs over the rows of one engine:

    enqueue(n, batch)     step n of a run: n = 0 from the host's view of the batch (its
                          pending tokens, positions and drafts); n > 0 from what step n-1
                          left on the device (kinds that run ahead only)
    read(n) -> StepResult step n's tokens, accept lengths and next drafts, on the host
    close()

``DecodeSteps``     plain decode (M=1), control on the device (``runtime.decode_run``)
``FusedSteps``      verify + acceptance + the MTP head in one graph (``runtime.fused_run``)
``HostDecodeSteps`` plain decode whose tokens the host chooses (sampled rows), or whose
                    forwards run at exact mode's fixed shape or in pipeline stages
``TwoRunSteps``     verify (the commit strategy's), acceptance on the host, then the head's
                    catch-up in a Run of its own: sampled rows, readvance, exact mode, pipeline
                    stages, scripted drafts, and a step whose next k differs from its own

The host kinds also run every step with a row that asks for log-probabilities, and hand them
on in the StepResult (``logprobs``: from the logits of each emitted token's row).

The first two run ahead (``ahead``): the loop may enqueue step n+1 before it reads step n.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import InternalError
from ..manifest import Manifest, graph_name
from ..runtime.decode_run import DecodeRun
from ..runtime.engines import Engine
from ..runtime.fused_run import FusedRun
from ..runtime.kv_window import RunBound
from . import logprobs, sampler
from .commits import SelectCommit
from .drafts import MTPDrafts
from .head import Head
from .logprobs import TokenLogprob
from .requests import Batch
from .sampling import accept_lengths
from .stats import Stats


@dataclasses.dataclass
class StepResult:
    """One step as the host reads it. Row j emits tokens[j, :accepted[j] + 1]."""

    first: np.ndarray  # int64 [B] T: each row's first position in this step
    tokens: np.ndarray  # int64 [B, k+1]: e_0..e_k, the drafts kept and then the bonus token
    accepted: np.ndarray  # int64 [B]: a (0 for a decode)
    next_drafts: np.ndarray | None = None  # int64 [B, k]: the head's drafts (None: set on the requests already)
    hidden: np.ndarray | None = None  # [B, H] host: a decode's hidden rows, the head's deferred entries
    hidden_dtype: object = None  # their dtype on the device
    logprobs: dict[int, list[TokenLogprob]] | None = None  # row j -> its tokens' log-probabilities (rows that ask)


class DecodeSteps:
    """Plain decode steps with the control on the device: greedy rows, and sampled ones drawn on the
    device (``decode_sample``: each step gets its rows' uniforms, drawn from their own streams)."""

    ahead, phase = True, "decode"

    def __init__(self, engine: Engine, batch: Batch, stats: Stats, defer_head: bool, sampled: bool = False) -> None:
        self.run = DecodeRun(engine.target, batch.rows, hidden=defer_head, bound=RunBound.of(batch.requests),
                             sampled=sampled)
        self.stats, self.requests, self.sampled = stats, batch.requests, sampled
        self._accepted = np.zeros(len(batch), np.int64)  # [B]: a decode accepts no drafts

    def enqueue(self, n: int, batch: Batch | None = None) -> None:
        with self.stats.timed("decode"):
            sampling = sampler.device_inputs(self.requests, 0).feeds() if self.sampled else None
            if n == 0:
                self.run.enqueue(0, batch.pending[:, None], batch.processed[:, None], sampling)  # [B, 1] each
            else:
                self.run.enqueue(n, sampling=sampling)

    def read(self, n: int) -> StepResult:
        with self.stats.timed("decode"):
            tokens, hidden = self.run.read(n)  # [B], [B, H] or None
        return StepResult(self.run.positions(n), tokens[:, None], self._accepted, hidden=hidden,
                          hidden_dtype=self.run.hidden_dtype)

    def fits_next(self, n: int, running: np.ndarray) -> bool:
        return True  # positions past max_length - 1 are clamped, and no running row gets there

    def close(self) -> None:
        self.run.close()


class FusedSteps:
    """Fused speculative steps of k drafts (next k = k). The host keeps a mirror of each step's
    first positions and drafts, to check the graph's accept lengths against its own rule (greedy
    rows) and to emit. Steps after the first verify the drafts the graph made, so a run goes on
    ahead only with the head's own drafts (a scripted source proposes every step from the host).
    sampled: ``verify_mtp_sample_k{k}`` accepts sampled rows by exact speculative sampling and
    draws their next drafts on the device; the distributions the drafts were drawn from go up from
    the requests at the run's start and come back to them at its end (two-Run steps read them)."""

    phase = "verify"

    def __init__(self, engine: Engine, batch: Batch, stats: Stats, k: int, draft_source, sampled: bool = False) -> None:
        self.ahead = type(draft_source) is MTPDrafts
        bound = (RunBound.of if self.ahead else RunBound.one_step)(batch.requests)  # a run of one step otherwise
        self.run = FusedRun(engine.target, engine.mtp, batch.rows, k, bound, sampled=sampled)
        self.stats, self.k, self.draft_source, self.sampled = stats, k, draft_source, sampled
        self.requests, self.arrays = batch.requests, engine.arrays
        self._greedy = [not r.samples for r in batch.requests]  # [B]: the rows the host checks
        self._mirror: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # n -> (T [B], drafts [B, k]) of step n

    def enqueue(self, n: int, batch: Batch | None = None) -> None:
        if n == 0:
            with self.stats.timed("propose"):
                drafts = self.draft_source.propose(batch, self.k)  # [B, k]
        with self.stats.timed("verify"):
            sampling = sampler.device_inputs(self.requests, self.k).feeds() if self.sampled else None
            if n == 0:
                if self.sampled:
                    self._upload_draft_probs()
                self._mirror[0] = (batch.processed, drafts)
                self.run.enqueue(0, np.concatenate([batch.pending[:, None], drafts], axis=1),  # [B, k+1]
                                 batch.processed[:, None] + np.arange(self.k + 1), sampling)  # [B, k+1]
            else:
                self.run.enqueue(n, sampling=sampling)

    def _upload_draft_probs(self) -> None:
        """q [B, k, V] of the drafts step 0 verifies: each sampled request's (from the catch-up that
        drew them), zeros for greedy rows (their acceptance reads none)."""
        vocab = self.run.graphs.manifest.spec.vocab_size
        q = np.zeros((len(self.requests), self.k, vocab), np.float32)
        for j, req in enumerate(self.requests):
            if req.samples and req.draft_probs is not None:
                q[j] = req.draft_probs[: self.k]
        self.run.rows.put(self.arrays, self.run.mtp.draft_probs(self.k), self.arrays.from_host(q, np.float32))

    def read(self, n: int) -> StepResult:
        k = self.k
        with self.stats.timed("verify"):
            step_ids = self.run.read(n)  # [B, 2k+2]
        T, drafts = self._mirror.pop(n)
        tokens, accepted, next_drafts = step_ids[:, : k + 1], step_ids[:, k + 1], step_ids[:, k + 2:]
        self.check_acceptance(accepted, drafts, tokens)
        last = self.run.last_start  # T_{n+1} = min(T_n + a + 1, last_start), as ints (a step's few rows)
        self._mirror[n + 1] = (np.array([min(t + a + 1, last) for t, a in zip(T.tolist(), accepted.tolist())],
                                        np.int64), next_drafts)
        return StepResult(T, tokens, accepted, next_drafts)

    def check_acceptance(self, accepted: np.ndarray, drafts: np.ndarray, tokens: np.ndarray) -> None:
        """The graph's accept lengths [B] must be the host rule's over drafts [B, k] and tokens
        [B, k+1], for every greedy row (a sampled row's are drawn): a = the longest prefix with
        d_i == g_{i-1}, i.e. drafts 1..a match and draft a+1 (if any) does not. Checked in Python
        ints (a step's few rows); the rule's numpy form (``accept_lengths``) only for the error."""
        k, rows = self.k, zip(self._greedy, accepted.tolist(), drafts.tolist(), tokens.tolist())
        if not all(not greedy or (d[:a] == g[:a] and (a == k or d[a] != g[a])) for greedy, a, d, g in rows):
            host, greedy = accept_lengths(drafts, tokens), np.array(self._greedy)
            raise acceptance_mismatch(self.k, np.where(greedy, accepted, -1), np.where(greedy, host, -1), drafts,
                                      tokens, "its rows' states are wrong until a prefill resets them")

    def fits_next(self, n: int, running: np.ndarray) -> bool:
        """Whether step n+1's k+1 positions fit for every running row: T_{n+1} <= T_n + k + 1
        (step n's T is known once step n-1 was read)."""
        T = self._mirror[n][0]
        return bool(np.all(T[running] + self.k + 1 <= self.run.last_start))

    def close(self) -> None:
        self.run.close()
        if self.sampled:  # the next drafts' q back to their requests: a two-Run step accepts on the host
            q = self.arrays.download(self.run.rows.take(self.arrays, self.run.mtp.draft_probs(self.k)))  # [B, k, V]
            for j, req in enumerate(self.requests):
                req.draft_probs = q[j] if req.samples else None


class HostDecodeSteps:
    """One plain decode step whose tokens the host picks (``sampler.pick``: argmax or a draw)."""

    ahead, phase = False, "decode"

    def __init__(self, engine: Engine, forwards, stats: Stats, defer_head: bool) -> None:
        self.engine, self.forwards, self.stats, self.defer_head = engine, forwards, stats, defer_head
        self._result: StepResult | None = None

    def enqueue(self, n: int, batch: Batch) -> None:
        with self.engine.step(), self.stats.timed("decode"):
            out = self.forwards.advance(batch.rows, batch.pending[:, None], batch.processed[:, None])
            at = np.zeros(len(batch), np.int64)
            tokens = sampler.pick(batch.requests, out, at)  # [B]
            token_logprobs = logprobs.of_forward(batch.requests, out, tokens[:, None], at)
            hidden = self.engine.arrays.download(out["hidden"])[:, 0] if self.defer_head else None  # [B, H]
        self._result = StepResult(batch.processed, tokens[:, None], np.zeros(len(batch), np.int64),
                                  hidden=hidden, hidden_dtype=out["hidden"].dtype, logprobs=token_logprobs)

    def read(self, n: int) -> StepResult:
        return self._result

    def close(self) -> None:
        self._result = None


class TwoRunSteps:
    """One speculative step in two Runs: the commit strategy's verify over [x_T, d_1..d_k], the
    acceptance on the host (``sampler.accept``: the greedy rule, or exact speculative sampling),
    then the head's catch-up over the accepted tokens, drafting ``drafts`` for the next step."""

    ahead, phase = False, "verify"

    def __init__(self, engine: Engine, commit, draft_source, head: Head, stats: Stats, k: int, drafts: int) -> None:
        self.engine, self.commit, self.draft_source, self.head = engine, commit, draft_source, head
        self.stats, self.k, self.drafts = stats, k, drafts
        self._result: StepResult | None = None

    def enqueue(self, n: int, batch: Batch) -> None:
        k, T = self.k, batch.processed
        with self.engine.step():
            # 1. propose: k drafts per request                                         [B, k]
            with self.stats.timed("propose"):
                drafts = self.draft_source.propose(batch, k)
            # 2. verify: one target forward over [x_T, d_1..d_k] at positions T..T+k   [B, k+1]
            ids = np.concatenate([batch.pending[:, None], drafts], axis=1)
            with self.stats.timed("verify"):
                verified = self.commit.verify(batch, ids, T[:, None] + np.arange(k + 1))
            # 3. accept: greedy rows: a = longest prefix with d_i == g_{i-1}, bonus g_a. Sampled rows:
            #    d_i kept with probability min(1, p_{i-1}(d_i) / q_i(d_i)), bonus drawn from
            #    norm(max(0, p_a - q_{a+1})), or from p_k when a = k (sampling.py). Emit d_1..d_a, bonus.
            accepted, bonus = sampler.accept(batch.requests, drafts, verified.out)  # [B], [B]
            emitted = np.concatenate([drafts, bonus[:, None]], axis=1)  # [B, k+1]
            emitted[np.arange(len(batch)), accepted] = bonus
            token_logprobs = logprobs.of_forward(batch.requests, verified.out, emitted)  # e_i from verify row i
            # 4. commit every state to T + a + 1 tokens, as if decoded one by one: the MTP head
            #    first (it reads the verify's hiddens, which readvance's re-runs may overwrite)
            with self.stats.timed("commit"):
                out = verified.out  # entry T+i holds x_{T+i+1} = e_i (past a: padding, never written)
                self.head.catch_up(batch.rows, out["hidden"], emitted, out.positions, accepted, batch.requests,
                                   max(self.drafts, 1))
                self.commit.commit(batch, verified, accepted, self.stats)
        self._result = StepResult(T, emitted, accepted, logprobs=token_logprobs)

    def read(self, n: int) -> StepResult:
        return self._result

    def close(self) -> None:
        self._result = None


def fusable_ks(manifest: Manifest, commit: str, exact: bool, stages: int) -> frozenset[int]:
    """The verify widths k whose steps may run as one graph: none with another commit than select,
    in exact mode (its forwards run at one fixed shape in row groups), with pipeline stages, or for
    a model converted before verify_mtp_k{k} existed (it runs as it always did)."""
    if commit != SelectCommit.name or exact or stages != 1:
        return frozenset()
    return frozenset(k for k in range(1, manifest.num_speculative_tokens + 1)
                     if graph_name("verify_mtp", k) in manifest.graphs)


class StepKinds:
    """What the steps of one Decoder can run as, fixed when it is built; ``choose`` picks a step's
    kind from its k, the drafts its head makes for the next step and its requests (a live row
    that samples or asks for log-probabilities needs the logits on the host: a host kind).

    device: the steps whose control can stay on the device may run so (one pipeline stage, not
    exact mode; on CUDA the stream shared with ONNX Runtime). fused_ks: the k with a fused graph
    (select commit, converted with it). sampled_ks: the k (0: a decode) whose steps can sample on
    the device (``sampling_ks``)."""

    def __init__(self, engine: Engine, forwards, commit, draft_source, head: Head | None, stats: Stats,
                 device: bool, fused_ks: frozenset[int], sampled_ks: frozenset[int] = frozenset()) -> None:
        self.engine, self.forwards, self.commit, self.draft_source = engine, forwards, commit, draft_source
        self.head, self.stats, self.device, self.fused_ks = head, stats, device, fused_ks
        self.sampled_ks = sampled_ks

    def choose(self, requests, k: int, drafts: int) -> type:
        on_device = self.device and not sampler.asks_logprobs(requests)  # log-probabilities need the logits
        if sampler.samples(requests):  # sampled rows draw on the device where the model has the graph
            on_device = on_device and k in self.sampled_ks
        if k == 0:
            return DecodeSteps if on_device else HostDecodeSteps
        return FusedSteps if on_device and k == drafts and k in self.fused_ks else TwoRunSteps

    def open(self, kind: type, batch: Batch, k: int, drafts: int):
        defer, sampled = self.head is not None, sampler.samples(batch.requests)
        if kind is DecodeSteps:
            return DecodeSteps(self.engine, batch, self.stats, defer, sampled)
        if kind is HostDecodeSteps:
            return HostDecodeSteps(self.engine, self.forwards, self.stats, defer)
        if kind is FusedSteps:
            return FusedSteps(self.engine, batch, self.stats, k, self.draft_source, sampled)
        return TwoRunSteps(self.engine, self.commit, self.draft_source, self.head, self.stats, k, drafts)


def sampling_ks(manifest: Manifest, fused: frozenset[int], draft_source) -> frozenset[int]:
    """The k whose steps can sample on the device: 0 with ``decode_sample``; k >= 1 with a fused
    graph and ``verify_mtp_sample_k{k}``, and the head's own drafts (a scripted source gives no
    distributions to accept against). (The tempered graphs of models converted in sessions 9-11,
    decode_tempered / verify_mtp_tempered_k{k}, are not run: the sample graphs serve every row.)"""
    ks = {0} if "decode_sample" in manifest.graphs else set()
    if type(draft_source) is MTPDrafts:
        ks |= {k for k in fused if graph_name("verify_mtp_sample", k) in manifest.graphs}
    return frozenset(ks)


def acceptance_mismatch(k: int, graph: np.ndarray, host: np.ndarray, drafts: np.ndarray, tokens: np.ndarray,
                        consequence: str) -> InternalError:
    """The error for a fused graph whose accept lengths graph [B] differ from the host rule's host [B]
    over drafts [B, k] and target tokens [B, k+1]; consequence: what that left behind."""
    return InternalError(
        f"the graph {graph_name('verify_mtp', k)} accepted {graph.tolist()} drafts where the greedy rule "
        f"accepts {host.tolist()} (drafts {drafts.tolist()}, target tokens {tokens.tolist()}); {consequence}. "
        "The model's fused graph is wrong: report it with the model directory; "
        "generate(..., fused_verify=False) runs without it.")
