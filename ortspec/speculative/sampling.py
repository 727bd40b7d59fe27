"""How tokens are chosen from probabilities: the sampling transform, draws, and the acceptance
rules of speculative decoding (greedy and exact speculative sampling). Pure numpy, no model.

The transform (``transform``) is the one every sampled token goes through, on the target's
logits here and in the sampling graphs (converter/sampling_graph.py builds the same steps in
ONNX): logits / temperature, then top-k, then top-p, then softmax. The MTP head's drafts go
through it in the CPU graphs; the portable graphs draw them from softmax(logits / temperature).

Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023), per request, with drafts
d_1..d_k drawn from the head's distributions q_1..q_k and the target's p_0..p_k from one verify
(p_i is the target's distribution after row i, so d_{i+1} is checked against p_i):

    accept d_{i+1} with probability min(1, p_i(d_{i+1}) / q_{i+1}(d_{i+1})), i = 0, 1, ...
    at the first rejection i = a: emit norm(max(0, p_a - q_{a+1})) drawn
    after k acceptances (a = k):    emit a bonus drawn from p_k

Each emitted token is then distributed exactly as p (the target's transformed distribution)
given the tokens before it, whatever q is; q only sets how many drafts survive.
"""

from __future__ import annotations

import dataclasses

import numpy as np

MIN_TEMPERATURE = 1e-4  # below this (and above 0) logits / T overflows float32 in the head's graph


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's sampling: temperature 0 is greedy (the default); top_k 0, top_p 1 and min_p 0
    are off. seed None draws from the OS's entropy; an int makes the request's tokens reproducible."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()


def random_stream(params: SamplingParams, index: int) -> np.random.Generator | None:
    """The random stream of the index-th request of a call: None when greedy. Streams of one seed
    are independent across indices (SeedSequence spawn keys), and index 0 is what a single prompt
    gets, so generate(p, seed=s) == generate([p, q], seed=s)[0] == the batcher's add_request(p, seed=s)."""
    if params.greedy:
        return None
    return np.random.default_rng(np.random.SeedSequence(params.seed, spawn_key=(index,)))


def accept_lengths(drafts: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Greedy rule: a_j = max{ i <= k : d_{j,1..i} == g_{j,0..i-1} }, the longest prefix of drafts
    [B, k] that matches the target argmaxes [B, >= k+1] (draft i is checked against g_{i-1})."""
    k = drafts.shape[1]
    match = drafts == targets[:, :k]  # [B, k]
    return np.where(match.all(axis=1), k, np.argmin(match, axis=1)).astype(np.int64)


def transform(logits: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
              min_p: np.ndarray | None = None) -> np.ndarray:
    """Probabilities [N, V] (float64) from logits [N, V], one request per row (temperature > 0).

    top-k keeps the tokens whose scaled logit is >= the k-th largest (0: all); top-p then keeps
    the most probable tokens, in order, while the probability mass before each is < top_p (so
    at least one, and the smallest set reaching top_p); ties with the last kept value are kept.
    min-p (0: off) then keeps those of probability >= min_p times the largest's.
    """
    z = logits.astype(np.float64) / temperature[:, None]  # [N, V]
    vocab = z.shape[1]
    ordered = -np.sort(-z, axis=1)  # [N, V] descending
    kept_by_k = np.where(top_k > 0, np.minimum(top_k, vocab), vocab)  # [N]
    rank = np.arange(vocab)
    ordered = np.where(rank < kept_by_k[:, None], ordered, -np.inf)
    mass = np.exp(ordered - ordered[:, :1])
    mass /= mass.sum(axis=1, keepdims=True)
    before = np.cumsum(mass, axis=1) - mass  # probability mass ahead of each rank
    kept = (rank < kept_by_k[:, None]) & ((before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    threshold = ordered[np.arange(len(z)), kept.sum(axis=1) - 1]  # [N] smallest kept logit
    if min_p is not None:
        with np.errstate(divide="ignore"):  # log 0 = -inf: off
            threshold = np.maximum(threshold, z.max(axis=1) + np.log(min_p))
    z = np.where(z >= threshold[:, None], z, -np.inf)
    probs = np.exp(z - z.max(axis=1, keepdims=True))
    return probs / probs.sum(axis=1, keepdims=True)


def draw(weights: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF draws [N] from non-negative weights [N, V] (need not sum to 1) with uniforms
    u [N] in [0, 1). A token of weight 0 is never drawn (rounding cannot push past the last
    positive one)."""
    cdf = np.cumsum(weights, axis=1)  # [N, V]
    below = (cdf <= (u * cdf[:, -1])[:, None]).sum(axis=1)
    last_positive = weights.shape[1] - 1 - np.argmax(weights[:, ::-1] > 0, axis=1)
    return np.minimum(below, last_positive).astype(np.int64)


def speculative_accept(p: np.ndarray, q: np.ndarray, drafts: np.ndarray, u_accept: np.ndarray,
                       u_emit: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact speculative sampling (module docstring) for B requests with k drafts each.

    p [B, k+1, V] the target's probabilities after verify rows 0..k; q [B, k, V] the head's, q[:, i]
    the distribution d_{i+1} = drafts[:, i] was drawn from; u_accept [B, k] and u_emit [B] uniforms.
    Returns (a [B] drafts accepted, the token emitted after them [B]).
    """
    B, k = drafts.shape
    rows = np.arange(B)
    p_draft = np.take_along_axis(p[:, :k], drafts[..., None], axis=2)[..., 0]  # p_i(d_{i+1})  [B, k]
    q_draft = np.take_along_axis(q, drafts[..., None], axis=2)[..., 0]  # q_{i+1}(d_{i+1})      [B, k]
    accept = u_accept * q_draft < p_draft  # u < p/q: with probability min(1, p/q)
    a = np.where(accept.all(axis=1), k, np.argmin(accept, axis=1))  # [B]
    q_padded = np.concatenate([q, np.zeros_like(q[:, :1])], axis=1)  # q_{k+1} = 0: the bonus draws from p_k
    residual = np.maximum(p[rows, a] - q_padded[rows, a], 0.0)  # [B, V]
    empty = residual.sum(axis=1) <= 0.0  # p_a == q_a: a rejection had probability 0; draw from p_a
    residual[empty] = p[rows[empty], a[empty]]
    return a.astype(np.int64), draw(residual, u_emit)
