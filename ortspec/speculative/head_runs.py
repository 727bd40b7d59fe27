"""Where a speculative step runs the MTP head's catch-up: in its own graph after the verify (two
Runs per step), or inside the verify's graph (one Run). One object per way, each answering:

    verify(batch, ids, positions) -> Verified          the target over [x_T, d1..dk] at T..T+k
    catch_up(batch, verified, accepted, bonus, drafts) the head's entries T..T+a, and its next
                                                        `drafts` drafts (request.next_drafts)

``CatchUpAfterVerify`` (any step): the commit strategy's verify; then, from the tokens the host
accepted, the head's own graph (``mtp_propose_k{n}``, or ``mtp_sample_k{n}`` when a request
samples) over the verify's hiddens.

``CatchUpInVerify``: ``verify_mtp_k{k}`` (converter/fused_graph.py) runs the select verify, the
greedy acceptance and the head in one graph, and the host reads tokens, accept lengths and drafts
in one download. Only where the graph's work is exactly the two-Run step's (``applies``): select
commit, no exact mode, one pipeline stage, a model converted with the graph; and per step, every
live request greedy (a sampled acceptance draws on the host) and the next step verifying as many
drafts as this one (the graph drafts k; auto k may choose another). The host still computes the
acceptance from the downloaded tokens (``sampler.accept``): if the graph's differs, nothing is
committed and an InternalError says so, so a converter bug cannot change an output unnoticed.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..errors import InternalError
from ..manifest import Manifest, graph_name
from ..runtime.engines import Engine
from . import sampler
from .commits import SelectCommit, Verified
from .requests import Batch, Request


def fusable_ks(manifest: Manifest, commit: str, exact: bool, stages: int) -> frozenset[int]:
    """The verify widths k whose steps may run as one graph: none with another commit than select,
    in exact mode (its forwards run at one fixed shape in row groups), with pipeline stages, or for
    a model converted before verify_mtp_k{k} existed (it runs as it always did)."""
    if commit != SelectCommit.name or exact or stages != 1:
        return frozenset()
    return frozenset(k for k in range(1, manifest.num_speculative_tokens + 1)
                     if graph_name("verify_mtp", k) in manifest.graphs)


class CatchUpAfterVerify:
    """Two Runs: the commit strategy's verify, then the head's catch-up over what the host accepted.

    catch_up_run(rows, hidden, next_ids, positions, last, requests, drafts) is the Decoder's own
    catch-up (the one its prefill and decode steps run), which fills request.next_drafts."""

    def __init__(self, commit, catch_up_run: Callable) -> None:
        self.commit, self.catch_up_run = commit, catch_up_run

    def verify(self, batch: Batch, ids: np.ndarray, positions: np.ndarray) -> Verified:
        return self.commit.verify(batch, ids, positions)

    def catch_up(self, batch: Batch, verified: Verified, accepted: np.ndarray, bonus: np.ndarray, drafts: int) -> None:
        """Entry p = T+i holds x_{p+1}: d_{i+1} for i < a, the bonus at i = a (rows past a: padding)."""
        next_ids = np.concatenate([verified.ids[:, 1:], bonus[:, None]], axis=1)  # [B, k+1]
        next_ids[np.arange(len(batch)), accepted] = bonus
        out = verified.out
        self.catch_up_run(batch.rows, out["hidden"], next_ids, out.positions, accepted, batch.requests, drafts)


class CatchUpInVerify:
    """One Run: ``verify_mtp_k{k}``, the verify, the greedy acceptance and the head in one graph."""

    def __init__(self, engine: Engine, ks: frozenset[int]) -> None:
        self.target, self.mtp, self.ks = engine.target, engine.mtp, ks  # ks: the verify widths with a graph

    @classmethod
    def create(cls, engine: Engine, manifest: Manifest, commit: str, exact: bool) -> "CatchUpInVerify | None":
        """None where no step on this engine can run fused (``fusable_ks``), or without an MTP head."""
        ks = fusable_ks(manifest, commit, exact, engine.target.stages)
        return cls(engine, ks) if ks and engine.mtp is not None else None

    def applies(self, requests: list[Request], k: int, drafts: int) -> bool:
        """This step (k drafts to verify, then ``drafts`` for the next step) can run as one graph."""
        return k == drafts and k in self.ks and sampler.all_greedy(requests)

    def verify(self, batch: Batch, ids: np.ndarray, positions: np.ndarray) -> Verified:
        out, accepted, next_drafts = self.target.verify_with_head(batch.rows, ids, positions, self.mtp)
        return Verified(out, ids, positions, accepted=accepted, next_drafts=next_drafts)  # [B], [B, k]

    def catch_up(self, batch: Batch, verified: Verified, accepted: np.ndarray, bonus: np.ndarray, drafts: int) -> None:
        """The head already ran: check its acceptance against the host's, keep its entries, hand on its drafts."""
        self.check_acceptance(verified, accepted)
        self.mtp.write_entries(verified.out, batch.rows, verified.positions, accepted)
        for req, row in zip(batch.requests, verified.next_drafts):
            req.next_drafts, req.draft_probs = row.tolist(), None

    def check_acceptance(self, verified: Verified, accepted: np.ndarray) -> None:
        """The graph's accept lengths must be the host's ([B] ints each): the head drafted from row a."""
        if not np.array_equal(verified.accepted, accepted):
            raise acceptance_mismatch(verified.ids.shape[1] - 1, verified.accepted, accepted, verified.ids[:, 1:],
                                      verified.out.tokens, "nothing was committed")


def acceptance_mismatch(k: int, graph: np.ndarray, host: np.ndarray, drafts: np.ndarray, tokens: np.ndarray,
                        consequence: str) -> InternalError:
    """The error for a fused graph whose accept lengths graph [B] differ from the host rule's host [B]
    over drafts [B, k] and target tokens [B, k+1]; consequence: what that left behind."""
    return InternalError(
        f"the graph {graph_name('verify_mtp', k)} accepted {graph.tolist()} drafts where the greedy rule "
        f"accepts {host.tolist()} (drafts {drafts.tolist()}, target tokens {tokens.tolist()}); {consequence}. "
        "The model's fused graph is wrong: report it with the model directory; "
        "generate(..., fused_verify=False) runs without it.")
