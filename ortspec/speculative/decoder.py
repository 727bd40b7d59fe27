"""Greedy and MTP-speculative decoding of a batch of requests.

The speculative step (``speculative_step``) is the heart of ortspec and reads top to
bottom: propose, verify, accept, commit. State mechanics live in runtime.states.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..runtime.engines import Engine
from ..runtime.graphs import GraphSet
from ..runtime.model import MTPHead
from ..runtime.states import Rows
from . import sampler
from .drafts import DraftSource, MTPDrafts
from .requests import Batch, Request
from .sampling import accept_lengths  # noqa: F401  (the greedy rule; imported from here by callers)
from .stats import Stats

COMMITS = ("select", "readvance")
PREFILL_GROUP_TOKENS = 4096  # prompt tokens per grouped prefill forward (bounds its [B, n, V] logits)


class Decoder:
    """Runs prefill, then greedy (k=0) or speculative (k>=1) steps until every request is done.

    One Decoder per generate call or batcher, over an ``Engine`` (state buffers for the batch)
    that its caller leased from the Session, or its own when none is given. Each step and
    prefill holds ``graphs.device_lock`` (on CUDA, steps of different callers never overlap).
    ``on_commit(decoder, batch)`` (tests) is called after every step's commit.

    On the CPU each step runs only the unfinished requests. On CUDA (``fixed_rows``) every
    step runs all rows, so the rows stay one contiguous range at fixed addresses; a finished
    request's row keeps running at its last position and its results are dropped.

    Tokens are chosen by ``sampler``: the argmax for greedy requests, draws for sampled ones.
    """

    def __init__(self, graphs: GraphSet, batch_size: int, k: int, commit: str, stats: Stats,
                 make_drafts: Callable[[MTPHead], DraftSource] = MTPDrafts,
                 on_commit: Callable[["Decoder", Batch], None] | None = None, fixed_rows: bool | None = None,
                 engine: Engine | None = None, stages: int = 1) -> None:
        self.graphs, self.k, self.commit, self.stats, self.on_commit = graphs, k, commit, stats, on_commit
        self.fixed_rows = graphs.arrays.device != "cpu" if fixed_rows is None else fixed_rows
        self.max_length = graphs.manifest.max_length
        self.engine = engine or Engine.create(graphs, batch_size, k, stages)
        self.target, self.mtp = self.engine.target, self.engine.mtp
        self.drafts = make_drafts(self.mtp) if k > 0 else None

    # -- driver ----------------------------------------------------------------------------
    def generate(self, requests: list[Request]) -> list[list[int]]:
        for _ in self.steps(requests):
            pass
        return [r.output() for r in requests]

    def steps(self, requests: list[Request]):
        """Prefills the requests (rows in order), then steps until all are done; yields after the
        prefill and after every step, so a caller can stream each request's new tokens."""
        for group in self._prefill_groups(requests):
            self.prefill_group(group)
        yield
        while self.step(requests):
            yield

    def _prefill_groups(self, requests: list[Request]) -> list[list[Request]]:
        """Runs of requests in consecutive rows with prompts of one length, at most
        PREFILL_GROUP_TOKENS prompt tokens each. On the CPU only: a token's bits there do not
        depend on the rows beside it (layers.py); a GPU library may pick another kernel for
        more rows, so on CUDA each request is prefilled alone, as it was checked."""
        if self.graphs.arrays.device != "cpu":
            return [[r] for r in requests]
        groups: list[list[Request]] = []
        for req in requests:
            last = groups[-1] if groups else None
            if (last and len(last[0].prompt) == len(req.prompt) and last[-1].row + 1 == req.row
                    and (len(last) + 1) * len(req.prompt) <= PREFILL_GROUP_TOKENS):
                last.append(req)
            else:
                groups.append([req])
        return groups

    def step(self, occupants: list[Request]) -> bool:
        """One step over the unfinished requests (all occupants when rows are fixed); False
        when none is left. ``occupants`` are the requests holding rows, in row order."""
        active = [r for r in occupants if not r.done]
        if not active:
            return False
        batch = Batch(occupants if self.fixed_rows else active)
        with self.graphs.device_lock:
            self.graphs.begin_step()
            room = self.max_length - 1 - int(batch.processed.max())  # last writable position - T
            if self.k > 0 and room >= self.k:
                self.speculative_step(batch)
            else:
                self.greedy_step(batch)
            if self.on_commit:
                self.on_commit(self, batch)
        return True

    def take_stats(self) -> Stats:
        """The counters since the last take (a batcher reports them to its Session after each call)."""
        stats, self.stats = self.stats, Stats()
        return stats

    def prefill(self, req: Request) -> None:
        self.prefill_group([req])

    def prefill_group(self, requests: list[Request]) -> None:
        """Requests with prompts of one length n in consecutive rows, in one forward: the target
        over the prompts (positions 0..n-1) -> each first token; then the MTP head's entries 0..n-1."""
        rows, n = Rows([r.row for r in requests]), len(requests[0].prompt)
        ids = np.array([r.prompt for r in requests], np.int64)  # [B, n]
        positions = np.tile(np.arange(n, dtype=np.int64), (len(requests), 1))  # [B, n]
        last = np.full(len(requests), n - 1, np.int64)  # [B]
        with self.graphs.device_lock, self.stats.timed("prefill"):
            self.target.reset(rows)
            out = self.target.prefill(rows, ids, positions)
            for req in requests:
                req.tokens = list(req.prompt)
            first = sampler.pick(requests, out, last)  # [B]
            if self.mtp is not None:
                next_ids = np.concatenate([ids[:, 1:], first[:, None]], axis=1)  # x_{p+1} for every p
                self._catch_up(rows, out["hidden"], next_ids, positions, last, requests, graphed=False)
        for req, token in zip(requests, first):
            req.extend([token])
            if not req.placeholder:
                self.stats.requests += 1
                self.stats.prompt_tokens += n
                self.stats.generated_tokens += 1

    # -- one step --------------------------------------------------------------------------
    def greedy_step(self, batch: Batch) -> None:
        """Plain decode: one target forward at M=1 (and one MTP entry, when speculating)."""
        positions = batch.processed[:, None]  # [B, 1]
        with self.stats.timed("decode"):
            out = self.target.decode(batch.rows, batch.pending[:, None], positions)
            tokens = sampler.pick(batch.requests, out, np.zeros(len(batch), np.int64))  # [B]
            if self.mtp is not None:
                self._catch_up(batch.rows, out["hidden"], tokens[:, None], positions,
                               np.zeros(len(batch), np.int64), batch.requests)
        self.stats.record_decode_step()
        for req, t in zip(batch.requests, tokens):
            if not req.done:
                self._emit(req, [t])

    def speculative_step(self, batch: Batch) -> None:
        k, T, rows = self.k, batch.processed, batch.rows
        self._check_positions(batch)
        # 1. propose: k drafts per request                                         [B, k]
        with self.stats.timed("propose"):
            drafts = self.drafts.propose(batch, k)
        # 2. verify: one target forward over [x_T, d_1..d_k] at positions T..T+k   [B, k+1]
        ids = np.concatenate([batch.pending[:, None], drafts], axis=1)
        positions = T[:, None] + np.arange(k + 1)
        with self.stats.timed("verify"):
            if self.commit == "select":
                out = self.target.verify_windows(rows, ids, positions)
            else:
                snapshot = self.target.snapshot(rows, T)
                out = self.target.verify(rows, ids, positions)
        # 3. accept: greedy rows: a = longest prefix with d_i == g_{i-1} (g: the target's argmaxes),
        #    bonus g_a. Sampled rows: d_i kept with probability min(1, p_{i-1}(d_i) / q_i(d_i)),
        #    bonus drawn from norm(max(0, p_a - q_{a+1})), or from p_k when a = k (sampling.py).
        #    Emit d_1..d_a and the bonus.
        accepted, bonus = sampler.accept(batch.requests, drafts, out)  # [B], [B]
        # 4. commit every state to T + a + 1 tokens, as if decoded one by one
        with self.stats.timed("commit"):
            if self.commit == "select":
                self.target.select(out, rows, positions, accepted)
            else:
                self._readvance(batch, snapshot, ids, positions, accepted)
            next_ids = np.concatenate([drafts, bonus[:, None]], axis=1)  # x_{p+1} for p = T..T+k
            next_ids[np.arange(len(batch)), accepted] = bonus
            self._catch_up(rows, out["hidden"], next_ids, positions, accepted, batch.requests)
        live = np.array([not r.done for r in batch.requests])
        self.stats.record_speculative_step(accepted[live], k)
        for j, req in enumerate(batch.requests):
            if live[j]:
                req.last_first_position, req.last_accepted = int(T[j]), int(accepted[j])
                self._emit(req, list(drafts[j, : accepted[j]]) + [bonus[j]])

    # -- commit mechanics ------------------------------------------------------------------
    def _readvance(self, batch: Batch, snapshot, ids, positions, accepted) -> None:
        """If a row rejected a draft: restore the pre-verify state and re-run the accepted
        tokens one at a time with the M=1 graph, keeping each row's state after its own
        a+1 tokens; rows that accepted everything keep the verify's state. All rows run
        together (on CUDA the rows are fixed), so the states after each re-run step are
        recorded and every row selects its own. Full acceptance of all rows re-runs nothing."""
        partial = accepted < self.k
        if not partial.any():
            return
        states, rows = self.target.states, batch.rows
        last = int(accepted[partial].max())
        recorded = [None] * (last + 1) + [states.capture(rows)]  # slot last+1: the verify's own state
        self.target.restore(snapshot, rows, batch.processed)
        for i in range(last + 1):
            self.target.decode(rows, ids[:, i: i + 1], positions[:, i: i + 1])
            recorded[i] = states.capture(rows)
        self.stats.readvance_forwards += last + 1
        states.select_captured(recorded, np.where(partial, accepted, last + 1), rows)

    def _catch_up(self, rows: Rows, hidden, next_ids, positions, last, requests, graphed=True) -> None:
        """MTP entries T..T+last[j] from the target's hiddens (rows past last[j] are padding
        and never written); the head's output at last[j] is the next step's d1. Sampled requests'
        drafts are drawn, and the distributions they came from kept for the acceptance."""
        sampling = sampler.draft_inputs(requests, self.k)
        if sampling is None:
            drafts = self.mtp.catch_up(rows, hidden, next_ids, positions, last, graphed=graphed)  # [B, k]
            probs = [None] * len(requests)
        else:
            drafts, probs = self.mtp.catch_up_sampled(rows, hidden, next_ids, positions, last, sampling,
                                                      graphed=graphed)  # [B, k], [B, k, V]
        for req, row, q in zip(requests, drafts, probs):
            req.next_drafts, req.draft_probs = row.tolist(), q if req.samples else None

    def _check_positions(self, batch: Batch) -> None:
        """The last accept length again, from positions: this step's first position minus the
        last step's, minus the bonus token. The states follow positions (every commit writes
        at T..T+a), so on disagreement positions win; the counter exposes the bug."""
        for req in batch.requests:
            if req.last_first_position is None or req.done:
                continue
            if req.processed - req.last_first_position - 1 != req.last_accepted:
                self.stats.position_mismatches += 1

    def _emit(self, req: Request, tokens) -> None:
        before = req.output_length
        req.extend(tokens)
        self.stats.generated_tokens += req.output_length - before
