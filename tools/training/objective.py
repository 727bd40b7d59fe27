"""The joint objective (target next token + MTP token after next) and random training windows."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def losses(model, mtp, batch: torch.Tensor, *, detach_mtp_hidden: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """batch [B, L+1] token windows -> (target CE, MTP CE), mean nats/token.

    Target position t (0..L-1) predicts x[t+1]; MTP position t (0..L-2) reads x[t+1] and h[t] and
    predicts x[t+2].
    """
    ids, labels = batch[:, :-1], batch[:, 1:]  # [B, L] x[0..L-1], x[1..L]
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state  # [B, L, H] final-normed
    logits = model.lm_head(hidden)  # [B, L, V]
    target_loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.reshape(-1))
    h = hidden[:, :-1].detach() if detach_mtp_hidden else hidden[:, :-1]  # h[0..L-2]
    positions = torch.arange(ids.shape[1] - 1, device=ids.device)
    out = mtp(model.model.embed_tokens, ids[:, 1:], h, positions)  # [B, L-1, H]
    mtp_logits = model.lm_head(out)  # [B, L-1, V]
    mtp_loss = F.cross_entropy(mtp_logits.flatten(0, 1).float(), labels[:, 1:].reshape(-1))  # x[2..L]
    return target_loss, mtp_loss


def random_windows(stream: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """[batch, length] windows at random offsets of a 1-D int stream -> long, on the stream's device.

    With a generator on the stream's device nothing waits for the host (no per-step sync).
    """
    starts = torch.randint(0, stream.numel() - length + 1, (batch,), generator=generator, device=generator.device)
    index = starts.to(stream.device)[:, None] + torch.arange(length, device=stream.device)  # [B, length]
    return stream[index].long()
