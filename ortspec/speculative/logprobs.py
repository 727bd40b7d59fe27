"""Log-probabilities of emitted tokens, for the requests that ask (``Request.logprobs``).

A token's log-probability is the log-softmax of the target's raw logits at the row that chose
it, whatever the request's temperature, top_k or top_p: the model's distribution, as OpenAI
reports it (a sampled token was drawn from the transformed one). Beside it, the N most
probable tokens of that row. The host kinds of step compute them (``step_kinds``: a request
that asks needs the logits on the host, as a sampled one does), the prefill for its first token.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..runtime.model import Forward


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability) of the most probable tokens, most probable first


def asking(requests) -> list[int]:
    """Indices of the live requests that ask for log-probabilities."""
    return [j for j, r in enumerate(requests) if r.logprobs is not None and not r.done]


def of_forward(requests, out: Forward, tokens: np.ndarray, at: np.ndarray | None = None,
               source=None) -> dict | None:
    """{j: [TokenLogprob of tokens[j, i] for each i]} for the live requests j that ask, None when
    none does: tokens [B, M] chosen after the forward's rows 0..M-1, or (at [B]) tokens [B, 1]
    chosen after row at[j] of request j. source: each request's batch row of out (sampler.pick)."""
    rows = asking(requests)
    if not rows:
        return None
    logits = out.logits(at)[:, None] if at is not None else out.logits()[:, : tokens.shape[1]]  # [B, M, V]
    logp = log_softmax(logits[rows if source is None else np.asarray(source)[rows]])  # [n, M, V]
    return {j: [token_logprob(row, int(t), requests[j].logprobs) for row, t in zip(logp[i], tokens[j])]
            for i, j in enumerate(rows)}


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """[..., V] float64 log-probabilities of float32 logits."""
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def token_logprob(logp: np.ndarray, token: int, top_n: int) -> TokenLogprob:
    """token's log-probability in one row logp [V], and the row's top_n most probable tokens, by log-probability then id."""
    top_n = min(top_n, len(logp))
    best = np.argpartition(-logp, top_n - 1)[:top_n] if 0 < top_n < len(logp) else np.arange(len(logp))[:top_n]
    best = best[np.lexsort((best, -logp[best]))]
    return TokenLogprob(token, float(logp[token]), tuple((int(t), float(logp[t])) for t in best))
