"""The exactness check: speculative decoding against a plain one-token-at-a-time decode.

``plain_decode_states`` runs greedy M=1 steps (feeding the MTP head every token, as a
speculative run does) and records every state after each token. ``check_speculative``
runs the speculative loop with scripted drafts that force chosen accept lengths, and after
every commit compares each request's states bitwise with the plain decode's at the same
length: target KV (live positions), GDN conv and recurrent states, the MTP head's KV, its
next draft and hidden. Used by the tests and by tools/exactness_run.py for long runs.
In exact mode (``exact=``) the speculative run pads its rows with placeholder requests to
whole groups and runs every forward at the fixed shape, and is still compared with the
plain (default-mode) decode: on the CPU both must give the same bits.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..runtime.engines import Engine
from ..runtime.forward_shapes import ExactShape
from ..runtime.graphs import GraphSet
from ..runtime.states import Rows
from .decoder import Decoder
from .drafts import MTPDrafts, ScriptedDrafts
from .head import Head
from .requests import Batch, Request
from .stats import Stats


class ExactnessError(AssertionError):
    """A speculative run left a state that differs from the plain decode's."""


@dataclasses.dataclass
class RowState:
    pending: int
    next_drafts: list[int]
    target: dict
    mtp: dict  # the head's KV cache

    def differences(self, other: "RowState", atol: float = 0.0, head: bool = True) -> list[str]:
        """Names of what differs; atol=0 means bitwise (CPU), else every element within
        atol * (1 + the largest |value| of that state in theirs) (GPU: the M=1 and M=k+1 products
        round differently, by an amount that scales with the vector they make, not with each
        element: a key element near 0 of a normalised head carries the head's rounding. Measured on
        the H200: 1.4e-5 on a key element of |value| < 0.4 at batch 16. A wrong slot or length
        differs by the values themselves).
        next_drafts may be fewer than the other's (auto k drafts k per step): they must be its
        first ones. head=False leaves out the MTP head's cache and drafts (auto k deferred its
        entries: ``deferred_entries``)."""
        same = np.array_equal if atol == 0 else (lambda a, b: within(a, b, atol))
        drafts = self.next_drafts if head else []
        diffs = []
        if (self.pending, drafts) != (other.pending, other.next_drafts[: len(drafts)]) or (head and not drafts):
            diffs.append(f"pending/next drafts {(self.pending, drafts)} vs {(other.pending, other.next_drafts)}")
        parts = (("target", self.target, other.target),) + ((("MTP", self.mtp, other.mtp),) if head else ())
        for label, mine, theirs in parts:
            diffs += [f"{label} state {n} (max abs diff {np.max(np.abs(mine[n] - theirs[n])):.2e})"
                      for n in theirs if not same(mine[n], theirs[n])]
        return diffs


def within(mine: np.ndarray, theirs: np.ndarray, atol: float) -> bool:
    """Every element of mine within atol * (1 + max |theirs|) of theirs (``RowState.differences``)."""
    scale = 1.0 + (float(np.max(np.abs(theirs))) if theirs.size else 0.0)
    return bool(np.all(np.abs(mine.astype(np.float64) - theirs) <= atol * scale))


def row_state(engine: Engine, req: Request) -> RowState:
    T = req.processed
    mtp = engine.mtp.row_state(req.row, T) if engine.mtp is not None else {}
    return RowState(req.pending, list(req.next_drafts), engine.target.states.row_state(req.row, T), mtp)


def make_requests(prompts, max_new_tokens, rows: int | None = None, stop_tokens=()):
    """One request per prompt in rows 0..n-1, then placeholders up to ``rows``."""
    requests = [Request(row=i, prompt=list(p), max_new_tokens=max_new_tokens, stop_tokens=frozenset(stop_tokens))
                for i, p in enumerate(prompts)]
    return requests + [Request.filler(i) for i in range(len(prompts), rows or len(prompts))]


def plain_decode_states(graphs: GraphSet, prompts, max_new_tokens: int, k: int, stages: int = 1):
    """The slow reference: each prompt prefilled alone, then greedy M=1 steps, the MTP head fed
    every token (drafting k) as a speculative run does. -> ({row: prompt + greedy tokens},
    {(row, length): RowState})."""
    engine = Engine.create(graphs, len(prompts), k, stages)
    head = Head(engine.mtp, graphs.arrays, pad_lengths=False) if engine.mtp is not None else None
    requests, table = make_requests(prompts, max_new_tokens), {}
    for req in requests:
        rows, n = Rows([req.row]), len(req.prompt)
        ids, positions = np.array([req.prompt], np.int64), np.arange(n, dtype=np.int64)[None]  # [1, n]
        with engine.step():
            engine.target.reset(rows)
            out = engine.target.prefill(rows, ids, positions)
            first = out.tokens[:, -1]  # [1]: the prompt's last row
            if head is not None:
                head.catch_up(rows, out["hidden"], np.concatenate([ids[:, 1:], first[:, None]], axis=1), out.positions,
                              np.array([n - 1]), [req], k, graphed=False)
        req.tokens = list(req.prompt)
        req.extend(first)
        table[(req.row, req.processed)] = row_state(engine, req)
    while not all(r.done for r in requests):
        batch = Batch([r for r in requests if not r.done])
        with engine.step():
            out = engine.target.decode(batch.rows, batch.pending[:, None], batch.processed[:, None])
            tokens = out.tokens[:, 0]  # [B]
            if head is not None:
                head.catch_up(batch.rows, out["hidden"], tokens[:, None], out.positions, np.zeros(len(batch), np.int64),
                              batch.requests, k)
        for req, token in zip(batch.requests, tokens):
            req.extend([token])
            table[(req.row, req.processed)] = row_state(engine, req)
    return {r.row: r.tokens for r in requests}, table


def check_speculative(graphs: GraphSet, prompts, max_new_tokens: int, k: int, commit: str, *,
                      p: float | None = None, seed: int = 0, reference=None, fixed_rows: bool | None = None,
                      atol: float = 0.0, stages: int = 1, exact: ExactShape | None = None,
                      k_chooser=None, fused_verify: bool = True, pipelined: bool | None = None,
                      stop_tokens=(), make_drafts=None) -> Stats:
    """Scripted-draft speculative run, states compared after every commit; raises ExactnessError.

    p=None draws each step's accept length uniformly from 0..k; else each draft is right with
    probability p. ``reference`` (from plain_decode_states with >= max_new_tokens + k + 1
    tokens) may be passed to reuse one plain decode for several runs. ``fixed_rows`` forces
    the all-rows batching CUDA uses; ``atol`` > 0 compares states within a tolerance (GPU);
    ``exact`` runs the speculative side in exact mode at that fixed shape; ``k_chooser`` runs
    it with auto k (k is then the most drafts per step), the head's state compared whenever no
    entries wait for it; ``fused_verify=False`` keeps the MTP head out of the verify's graph
    (by default every step that can runs as one graph: ``stats.fused_verify_steps``).
    ``pipelined=True`` runs the loop at depth 1 (the host a step ahead, ``decoder``) where the
    steps' kinds run ahead: their states are compared where a run ends, read out (a row that
    ended inside a run ran on past its end: its tokens are checked). ``stop_tokens`` end each request at the first of them, as greedy's output would.
    ``make_drafts``: the draft source (default: ``ScriptedDrafts`` with p and seed); ``MTPDrafts``
    where the caller scripts the head's own drafts wherever it makes them (the pipelined speculative
    loop makes each step's inputs on the device from them), the reference made under the same script.
    """
    oracle, table = reference or plain_decode_states(graphs, prompts, max_new_tokens + k + 1, k)
    stats, finished = Stats(), set()

    def compare(decoder, batch):
        for req in batch.requests:
            if req.row in finished or req.placeholder:
                continue  # a finished request's row that keeps running (fixed rows): no longer kept
            if req.done:
                finished.add(req.row)
            where = f"{commit} k={k} row {req.row} length {req.processed}"
            want = table.get((req.row, req.processed))
            if want is None:
                raise ExactnessError(f"{where}: the plain decode never reached this length")
            diffs = row_state(decoder.engine, req).differences(want, atol, head=not decoder.head.waiting)
            if diffs:
                raise ExactnessError(f"{where}: differs from the plain decode in {', '.join(diffs)}")
        finished.update(r.row for r in requests if r.done)  # those that ended unseen (a stretch) ran on

    vocab = graphs.manifest.spec.vocab_size
    requests = make_requests(prompts, max_new_tokens, exact.rows_for(len(prompts)) if exact else None, stop_tokens)
    truth = lambda r: r.tokens if r.placeholder else oracle[r.row]  # noqa: E731  (placeholders: any tokens)
    decoder = Decoder(graphs, len(requests), k, commit, stats, on_commit=compare, fixed_rows=fixed_rows, stages=stages,
                      exact=exact, k_chooser=k_chooser, fused_verify=fused_verify, pipelined=pipelined,
                      make_drafts=make_drafts or (lambda mtp: ScriptedDrafts(MTPDrafts(mtp), truth, vocab, p=p,
                                                                             seed=seed)))
    for req, out in zip(requests[: len(prompts)], decoder.generate(requests)):
        want = oracle[req.row][len(req.prompt): len(req.prompt) + max_new_tokens]
        want = want[: next((i + 1 for i, t in enumerate(want) if t in stop_tokens), len(want))]
        if out != want:
            raise ExactnessError(f"{commit} k={k} row {req.row}: tokens differ from greedy")
    if stats.position_mismatches:
        raise ExactnessError(f"{stats.position_mismatches} position mismatches")
    return stats
