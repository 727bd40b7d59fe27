"""Chooses the requests' tokens from a forward (the decoder calls these three functions):
the argmax for greedy requests, a draw from the transformed distribution for sampled ones;
and builds the inputs of the graphs that choose them on the device (``device_inputs``).

Sampled rows draw on the device where the model has the sampling graphs (``device_inputs``; a
prefill's first tokens through ``sample_logits``); logits come to the host only for a request that asks for log-probabilities, or where a step's
tokens are picked here (exact mode, pipeline stages, older models). A request that is done (a
finished row that keeps running on CUDA) draws nothing. Each sampled request draws from its own random stream, a
fixed count per event, so a seed reproduces its tokens whatever rows run beside it:

    pick           a token after one row (prefill, plain decode)       1 uniform
    accept         a speculative step's acceptance                     k + 1 uniforms
    draft_inputs   the head's k drafts at a catch-up                   k uniforms

    device_inputs(requests, k)   decode_sample (k = 0)                 1 uniform
                                 verify_mtp_sample_k{k}                2k + 1 uniforms: k + 1 for
                                                                       the acceptance, k for the drafts
"""

from __future__ import annotations

import numpy as np

from ..runtime.model import Forward
from ..runtime.sampling_inputs import SamplingInputs
from . import sampling
from .requests import Request


def _sampled(requests: list[Request]) -> list[int]:
    """Indices of the live requests that sample."""
    return [j for j, r in enumerate(requests) if r.samples and not r.done]


def samples(requests: list[Request]) -> bool:
    """A live request samples (finished rows draw nothing)."""
    return bool(_sampled(requests))


def mostly_samples(requests: list[Request]) -> bool:
    """More than half the live requests sample (the k policy keeps their measurements apart)."""
    return 2 * len(_sampled(requests)) > sum(not r.done for r in requests)


def asks_logprobs(requests: list[Request]) -> bool:
    """A live request asks for its tokens' log-probabilities (they need the logits on the host)."""
    return any(r.logprobs is not None and not r.done for r in requests)


def _params(requests: list[Request]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(temperature, top_k, top_p, min_p) [B] of these requests."""
    return (np.array([r.sampling.temperature for r in requests], np.float64),
            np.array([r.sampling.top_k for r in requests], np.int64),
            np.array([r.sampling.top_p for r in requests], np.float64),
            np.array([r.sampling.min_p for r in requests], np.float64))


def _uniforms(requests: list[Request], n: int) -> np.ndarray:
    """[B, n] float32 uniforms in [0, 1), each row from its request's stream."""
    return np.stack([r.random.random(n, dtype=np.float32) for r in requests])


def pick(requests: list[Request], out: Forward, at: np.ndarray, source=None, on_device=None) -> np.ndarray:
    """The token after row at[i] of out's batch row i for each request [R]: the argmax, or a draw
    for a sampled request. source [R]: each request's batch row (default: request j's is j; the
    forks of a prompt share its row). on_device(SamplingInputs) -> tokens [R] (a prefill's,
    ``TargetModel.sample_last_rows``): the draws made where the logits lie, with the same uniform
    each; not for forks, which draw apart from one row."""
    source = np.arange(len(requests)) if source is None else np.asarray(source)
    tokens = out.tokens[source, at[source]]  # [R]
    live = _sampled(requests)
    if live and on_device is not None and len(source) == len(out.tokens):
        tokens[live] = on_device(_inputs(requests, 1))[live]
    elif live:
        chosen = [requests[j] for j in live]
        probs = sampling.transform(out.logits(at)[source[live]], *_params(chosen))  # [n, V]
        tokens[live] = sampling.draw(probs, _uniforms(chosen, 1)[:, 0])
    return tokens


def accept(requests: list[Request], drafts: np.ndarray, out: Forward) -> tuple[np.ndarray, np.ndarray]:
    """(a [B] drafts accepted, the token emitted after them [B]) from a verify over [x_T, d_1..d_k]:
    greedy rows by the argmax rule, sampled rows by exact speculative sampling over the drafts'
    distributions (request.draft_probs, from the head's catch-up that drew them)."""
    targets = out.tokens  # [B, W]: W = k+1, or exact mode's K_fix+1 (pads after the step's k+1 rows)
    accepted = sampling.accept_lengths(drafts, targets)  # [B]
    bonus = targets[np.arange(len(requests)), accepted]  # [B]
    live = _sampled(requests)
    if live:
        chosen = [requests[j] for j in live]
        k = drafts.shape[1]
        logits = out.logits()[live, : k + 1]  # [n, k+1, V] (a forward padded past k+1 rows: not the step's)
        temperature, top_k, top_p, min_p = (np.repeat(x, k + 1) for x in _params(chosen))
        p = sampling.transform(logits.reshape(-1, logits.shape[2]), temperature, top_k, top_p,
                               min_p).reshape(logits.shape)
        q = np.stack([r.draft_probs for r in chosen])  # [n, k, V]
        u = _uniforms(chosen, k + 1)
        accepted[live], bonus[live] = sampling.speculative_accept(p, q, drafts[live], u[:, :k], u[:, k])
    return accepted, bonus


def draft_inputs(requests: list[Request], k: int) -> dict | None:
    """The sampling inputs of the head's catch-up (``mtp_sample_k{k}``), or None when no live
    request samples (then the argmax graph runs). Greedy and done rows get temperature 0."""
    if not _sampled(requests):
        return None
    return _inputs(requests, k).feeds()


def device_inputs(requests: list[Request], k: int) -> SamplingInputs:
    """The inputs of one step of the graphs that sample on the device: ``decode_sample`` (k = 0:
    uniforms [B, 1]) or ``verify_mtp_sample_k{k}`` (uniforms [B, 2k+1]: columns 0..k-1 the
    acceptances, k the emitted token, k+1..2k the next drafts). Each live sampled request draws
    its row from its own stream, the same count every step, so a seed reproduces its tokens for a
    given k whatever rows run beside it; greedy and done rows get temperature 0 and no draws."""
    return _inputs(requests, 1 if k == 0 else 2 * k + 1)


def _inputs(requests: list[Request], draws: int) -> SamplingInputs:
    """SamplingInputs of these requests with ``draws`` uniforms per sampled live row (others 0)."""
    live = _sampled(requests)
    temperature, top_k, top_p, min_p = _params(requests)
    samples = np.zeros(len(requests), bool)
    samples[live] = True
    uniforms = np.zeros((len(requests), draws), np.float32)
    if live:
        uniforms[live] = _uniforms([requests[j] for j in live], draws)
    return SamplingInputs(np.where(samples, temperature, 0.0).astype(np.float32), top_k, top_p.astype(np.float32),
                          min_p.astype(np.float32), uniforms)
