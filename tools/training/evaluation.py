"""Held-out loss and MTP acceptance as speculative decoding sees it (greedy chains)."""

from __future__ import annotations

import math
import time

import torch

from tools.training.objective import losses, random_windows

K_MAX = 4


@torch.no_grad()
def held_out_loss(model, mtp, stream: torch.Tensor, *, seq_len: int, max_tokens: int, batch: int) -> dict:
    """Teacher-forced target and MTP cross-entropy (nats/token) over non-overlapping windows."""
    num_windows = max(1, min((stream.numel() - 1) // seq_len, max_tokens // seq_len))
    length = min(seq_len, stream.numel() - 1)
    starts = torch.arange(num_windows, device=stream.device) * length
    totals = torch.zeros(4, dtype=torch.float64)  # target nats, target count, mtp nats, mtp count
    for i in range(0, num_windows, batch):
        index = starts[i : i + batch, None] + torch.arange(length + 1, device=stream.device)
        windows = stream[index].long()  # [b, L+1]
        target_loss, mtp_loss = losses(model, mtp, windows, detach_mtp_hidden=True)
        b = windows.shape[0]
        totals += torch.tensor([target_loss.item() * b * length, b * length,
                                mtp_loss.item() * b * (length - 1), b * (length - 1)], dtype=torch.float64)
    target = totals[0].item() / totals[1].item()
    return dict(loss=target, perplexity=math.exp(target), tokens=int(totals[1].item()),
                mtp_loss=totals[2].item() / totals[3].item())


@torch.no_grad()
def greedy_chains(model, mtp, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Committed tokens [B, T+1] -> (target greedy g [B, k], MTP drafts d [B, k]).

    g: the target decodes k tokens greedily after x[0..T] (no cache: a full forward per token).
    d: reference_drafts semantics: MTP position p = 0..T-1 pairs x[p+1] with h[p]; d1 = argmax at
    p = T-1; position T+j-1 pairs d_j with the MTP's own normed output at T+j-2.
    """
    seq, greedy, hidden = tokens, [], None
    for j in range(k):
        out = model.model(input_ids=seq, use_cache=False).last_hidden_state  # [B, n, H]
        if j == 0:
            hidden = out[:, :-1]  # h[0..T-1]
        greedy.append(model.lm_head(out[:, -1]).argmax(-1))  # [B]
        seq = torch.cat([seq, greedy[-1][:, None]], dim=1)
    ids, hiddens, drafts = tokens[:, 1:], hidden, []
    for j in range(k):
        out = mtp(model.model.embed_tokens, ids, hiddens, torch.arange(ids.shape[1], device=ids.device))
        drafts.append(model.lm_head(out[:, -1]).argmax(-1))  # [B]
        ids = torch.cat([ids, drafts[-1][:, None]], dim=1)
        hiddens = torch.cat([hiddens, out[:, -1:]], dim=1)
    return torch.stack(greedy, 1), torch.stack(drafts, 1)


def acceptance(matches: torch.Tensor) -> dict:
    """matches [N, K] bool (d_i == g_i) -> per-k accepted lengths and per-draft rates."""
    accepted_prefix = matches.long().cumprod(dim=1).float()  # [N, K]: 1 while every draft so far matched
    num_drafts = matches.shape[1]
    table = {}
    for k in range(1, num_drafts + 1):
        mean = accepted_prefix[:, :k].sum(1).mean().item()
        table[str(k)] = dict(mean_accepted=mean, acceptance_rate=mean / k, tokens_per_step=mean + 1)
    reached = [1.0, *accepted_prefix.mean(0).tolist()]  # reached[i] = P(accepted length >= i)
    per_draft = [dict(draft=i, p_accepted=reached[i],
                      p_accepted_given_previous=reached[i] / reached[i - 1] if reached[i - 1] else None)
                 for i in range(1, num_drafts + 1)]
    return dict(samples=matches.shape[0], by_k=table, per_draft=per_draft)


@torch.no_grad()
def mtp_acceptance(model, mtp, stream: torch.Tensor, *, num_chains: int, batch: int, max_context: int,
                   seed: int, k: int = K_MAX) -> dict:
    """Greedy-chain acceptance at random points of the held-out stream; context lengths 16..max_context."""
    generator = torch.Generator().manual_seed(seed + 2)
    min_context = min(16, max_context)
    matches = []
    done = 0
    while done < num_chains:
        b = min(batch, num_chains - done)
        context = int(torch.randint(min_context, max_context + 1, (1,), generator=generator))  # T+1
        tokens = random_windows(stream, b, context, generator)  # [b, T+1]
        greedy, drafts = greedy_chains(model, mtp, tokens, k)
        matches.append((greedy == drafts).cpu())
        done += b
    return acceptance(torch.cat(matches))


def evaluate(model, mtp, test_stream: torch.Tensor, settings, seed: int, bytes_per_token: float) -> dict:
    model.eval()
    mtp.eval()
    start = time.perf_counter()
    loss = held_out_loss(model, mtp, test_stream, seq_len=settings.seq_len, max_tokens=settings.eval_tokens,
                         batch=settings.eval_batch)
    loss["bits_per_byte"] = loss["loss"] / math.log(2) / bytes_per_token
    accept = mtp_acceptance(model, mtp, test_stream, num_chains=settings.eval_chains, batch=settings.eval_batch,
                            max_context=settings.seq_len - K_MAX, seed=seed)
    return dict(target=loss, mtp_acceptance=accept, eval_wall_s=round(time.perf_counter() - start, 2),
                precision="float16 weights, float32 compute", held_out_bytes_per_token=bytes_per_token)


def format_eval(result: dict) -> str:
    t, a = result["target"], result["mtp_acceptance"]
    lines = [f"held-out: loss {t['loss']:.4f} nats/token, perplexity {t['perplexity']:.2f}, "
             f"{t['bits_per_byte']:.3f} bits/byte over {t['tokens']:,} tokens; MTP (t+2) loss {t['mtp_loss']:.4f}",
             f"MTP greedy-chain acceptance, {a['samples']} samples:",
             "  k  mean accepted  acceptance rate  tokens/step",
             *[f"  {k}  {v['mean_accepted']:13.3f}  {v['acceptance_rate']:15.3f}  {v['tokens_per_step']:11.3f}"
               for k, v in a["by_k"].items()],
             "  draft  P(accepted)  P(accepted | previous accepted)",
             *[f"  {d['draft']:5d}  {d['p_accepted']:11.3f}  "
               f"{'-' if d['p_accepted_given_previous'] is None else format(d['p_accepted_given_previous'], '.3f'):>31}"
               for d in a["per_draft"]]]
    return "\n".join(lines)
