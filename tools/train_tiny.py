"""Train a small Qwen3.5-text hybrid (GDN + attention) with an MTP head on CPython's stdlib sources.

    python tools/train_tiny.py OUT_DIR [--minutes 8] [--device cuda] [--seed 0]
    python tools/train_tiny.py OUT_DIR --smoke          # tiny config, 20 CPU steps, < 60 s (CI)

What it does, in order:

1. Corpus: every *.py file under sysconfig's stdlib directory, sorted by relative path, read as
   UTF-8 (files that are not valid UTF-8 are skipped), site-packages/dist-packages excluded, the
   stdlib's own tests KEPT: they are most of the source (CPython 3.11: 34 MB of *.py, 14 MB without
   test directories, ~9.4 M tokens in all) and more text means less overfitting; a distro Python
   without the test package simply gives less text.
   --site-packages adds the *.py files of purelib after them. Reading stops at --max-corpus-mb.
   Split by path: sha1(relative path) % 1000 < 30 -> held-out test (~3%), else train.
   Files are joined with <|endoftext|> (id 0) between them, in both splits.
2. Tokenizer: byte-level BPE (tokenizers), vocab 4096, trained on the train split only;
   tokenizer.json + tokenizer_config.json.
3. Model: Qwen3_5ForCausalLM (qwen3_5_text), layers L L L F L L L F (L = Gated DeltaNet,
   F = gated full attention), hidden 512, 8/2 query/KV heads of 64, GDN 4 key / 8 value heads of 64,
   MLP 1408, partial rotary 0.25, untied lm_head: 29.7 M target parameters + 3.6 M MTP head
   (64 MiB of float16 in 5 shards).
   The MTP head (published Qwen3.5 layout, tests/reference_mtp.py) is trained jointly:

       e   = pre_fc_norm_embedding(embed(x[t+1]))         embed shared with the target
       h   = pre_fc_norm_hidden(h[t])                     h[t]: target's final-normed hidden
       z   = fc(concat(e, h))                             mtp.fc.weight [H, 2H]
       z   = layers.0(z)                                  a full-attention Qwen3_5DecoderLayer, causal
                                                          over the MTP positions, rope position t
       out = norm(z);  logits = lm_head(out)              lm_head shared; predicts x[t+2]

   loss = CE(target, x[t+1]) + 0.5 * CE(MTP, x[t+2]). h[t] is NOT detached (--detach-mtp-hidden
   to detach): the MTP loss also trains the trunk, as in DeepSeek-V3's MTP objective; the shared
   embedding and lm_head get gradients from both losses either way.
   AdamW (betas 0.9/0.95, wd 0.1 on Linear weights), linear warmup then cosine decay to 10% over
   the wall-clock budget (the schedule follows elapsed/--minutes, so it ends where training ends),
   grad clip 1.0, bf16 autocast on CUDA (fp32 master weights, TF32 allowed), fp32 on CPU.
   Batches are random windows of --seq-len + 1 tokens from the train token stream.
   HF runs its pure-torch GDN fallback (chunked delta rule, fp32 inside): no fla kernels needed.
4. Evaluation on the held-out split, after rounding the weights to float16 (= the saved
   checkpoint), fp32 compute: target loss (nats/token), perplexity, bits/byte; teacher-forced MTP
   loss; and MTP acceptance measured as speculative decoding sees it, with greedy chains: at a
   random point of held-out text (committed tokens x[0..T]) the target decodes g1..gK greedily and
   the MTP head drafts d1..dK recursively (d1 from (h[T-1], x[T]); later drafts from the head's own
   normed output and its previous draft, as tests/reference_mtp.py::reference_drafts).
   accepted(k) = longest prefix with d_i == g_i, i <= k. Reported for k = 1..4: mean accepted
   length, acceptance rate (= mean accepted / k), tokens per verify step (= mean accepted + 1), and
   per draft i: P(d_i accepted) and P(d_i accepted | d_1..d_{i-1} accepted). (Chains of different k
   share one K=4 chain: drafts and greedy tokens are prefix-consistent.)
5. Output (what `ortspec convert OUT_DIR x` takes unchanged):
       config.json                       model_type qwen3_5_text, mtp_num_hidden_layers 1, eos 0
       model-0000i-of-0000N.safetensors  float16, every file <= 15 MiB, keys as HF saves them
       model.safetensors.index.json      + every mtp.* key (mtp.layers.0.* named like a target
                                         full-attention layer)
       tokenizer.json, tokenizer_config.json, generation_config.json
       eval.json, train_log.json         metrics; losses, tokens/s, wall times, memory

On the GPU host (one H200; defaults batch 64 x 512 tokens): `python tools/train_tiny.py
out/tiny-stdlib --minutes 8 --device cuda`. Total wall time = --minutes + corpus and tokenizer
(20 s on 2 CPU cores, less on 16) + evaluation and saving (estimated < 1 min on the H200).
--compile (torch.compile of trunk and MTP head) is optional; its compile time counts against
--minutes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding  # noqa: E402

from tools.make_tiny_checkpoint import (  # noqa: E402
    FULL,
    LINEAR,
    MTPHead,
    build_config,
    checkpoint_tensors,
    mtp_layer_config,
    write_config,
    write_generation_config,
)

EOS = "<|endoftext|>"  # id 0: document separator and eos
VOCAB_SIZE = 4096
MAX_SHARD_BYTES = 15 * 2**20  # every safetensors file <= 15 MiB: small enough to bring back file by file
HELD_OUT_PER_MILLE = 30  # sha1(path) % 1000 < 30 -> held-out test split (~3%)
MTP_WEIGHT = 0.5
K_MAX = 4

# Model dimensions (any make_tiny_checkpoint.DEFAULTS key).
FULL_MODEL = dict(  # ~20M parameters with the MTP head: about 40 MB in fp16, small enough to ship
    hidden_size=384, intermediate_size=1024, vocab_size=VOCAB_SIZE,
    layer_types=(LINEAR, LINEAR, LINEAR, FULL) * 2,
    num_attention_heads=6, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=48, linear_value_head_dim=48,
    linear_conv_kernel_dim=4, partial_rotary_factor=0.25, rope_theta=10000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, max_position_embeddings=4096,
)  # fmt: skip
SMOKE_MODEL = dict(
    FULL_MODEL, hidden_size=64, intermediate_size=128, layer_types=(LINEAR, LINEAR, LINEAR, FULL),
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
)  # fmt: skip


@dataclass
class TrainSettings:
    """Everything that shapes a run; written into train_log.json."""

    seq_len: int
    batch_size: int
    minutes: float
    max_steps: int | None
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    mtp_weight: float
    detach_mtp_hidden: bool
    log_every: int
    eval_tokens: int
    eval_chains: int
    eval_batch: int


# ---------------------------------------------------------------------------------------------
# corpus and tokenizer


@dataclass
class Corpus:
    train: list[str]
    test: list[str]
    train_files: int
    test_files: int
    skipped_files: int
    sources: list[str]


def is_held_out(rel_path: str) -> bool:
    """Deterministic ~3% split by a hash of the path relative to its source root."""
    return int.from_bytes(hashlib.sha1(rel_path.encode()).digest()[:8], "big") % 1000 < HELD_OUT_PER_MILLE


def python_files(root: Path, *, skip_site_packages: bool) -> list[tuple[str, Path]]:
    """(relative path, path) of every *.py under root, sorted by relative path."""
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if skip_site_packages and ({"site-packages", "dist-packages"} & set(rel.parts)):
            continue
        if path.is_file():
            files.append((rel.as_posix(), path))
    return sorted(files)


def read_corpus(max_bytes: int, *, site_packages: bool = False) -> Corpus:
    """The stdlib (+ purelib) Python sources up to max_bytes, split into train and test."""
    roots = [Path(sysconfig.get_paths()["stdlib"])]
    if site_packages:
        roots.append(Path(sysconfig.get_paths()["purelib"]))
    corpus = Corpus([], [], 0, 0, 0, [str(r) for r in roots])
    total = 0
    for i, root in enumerate(roots):
        for rel, path in python_files(root, skip_site_packages=i == 0):
            if total >= max_bytes:
                return corpus
            try:
                text = path.read_bytes().decode("utf-8")
            except (UnicodeDecodeError, OSError):
                corpus.skipped_files += 1
                continue
            if not text.strip():
                continue
            total += len(text.encode())
            if is_held_out(f"{i}/{rel}"):
                corpus.test.append(text)
                corpus.test_files += 1
            else:
                corpus.train.append(text)
                corpus.train_files += 1
    return corpus


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """Byte-level BPE, <|endoftext|> = id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.token_to_id(EOS) != 0:
        raise RuntimeError(f"{EOS} got id {tokenizer.token_to_id(EOS)}, expected 0")
    return tokenizer


def write_tokenizer(tokenizer, out_dir: Path, model_max_length: int) -> None:
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts encoded (in parallel) and joined as  doc0 <eos> doc1 <eos> ... : int32 [N]."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(0)
    return torch.tensor(ids, dtype=torch.int32)


# ---------------------------------------------------------------------------------------------
# model


class TrainableMTP(MTPHead):
    """The `mtp.*` parameters (names from make_tiny_checkpoint.MTPHead) plus their forward.

    embed and lm_head are the target's (shared), passed in at call time.
    """

    def __init__(self, config: Qwen3_5TextConfig):
        super().__init__(config)
        self.rotary = Qwen3_5TextRotaryEmbedding(mtp_layer_config(config))  # buffers only, not saved
        self.attn_implementation = config._attn_implementation

    def forward(self, embed: nn.Embedding, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """ids [B, T] (x[t+1]), hidden [B, T, H] (h[t]), positions [T] -> normed output [B, T, H]."""
        batch, num_tokens = ids.shape
        e = self.pre_fc_norm_embedding(embed(ids))  # [B, T, H]
        h = self.pre_fc_norm_hidden(hidden)  # [B, T, H]
        x = self.fc(torch.cat([e, h], dim=-1))  # [B, T, H]
        position_ids = positions.reshape(1, -1).expand(batch, -1)  # [B, T]
        # transformers 5.17 wants text positions as (3, B, T); later versions expand (B, T) themselves
        cos_sin = self.rotary(x, position_ids.expand(3, *position_ids.shape) if position_ids.dim() == 2 else position_ids)
        x = self.layers[0](x, position_embeddings=cos_sin, attention_mask=self._mask(x), position_ids=position_ids)
        return self.norm(x)  # [B, T, H]

    def _mask(self, x: torch.Tensor) -> torch.Tensor | None:
        """None lets SDPA run causal (is_causal); eager attention needs an explicit additive mask."""
        if self.attn_implementation == "sdpa":
            return None
        num_tokens = x.shape[1]
        blocked = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=x.device).triu(1)
        mask = torch.zeros(num_tokens, num_tokens, dtype=x.dtype, device=x.device)
        return mask.masked_fill(blocked, torch.finfo(x.dtype).min)[None, None]  # [1, 1, T, T]

    def tensors(self) -> dict[str, torch.Tensor]:
        """mtp.* name -> tensor, as a published checkpoint names them."""
        return {f"mtp.{k}": v for k, v in self.state_dict().items() if not k.startswith("rotary")}


def build_models(dims: dict, *, seed: int, attn: str = "sdpa") -> tuple[Qwen3_5ForCausalLM, TrainableMTP]:
    """Fresh target + MTP head (fp32). HF init for the target; MTP Linear weights ~ N(0, 0.02²)."""
    torch.manual_seed(seed)
    config = build_config(mtp=True, dtype="float16", eos_token_id=0, **dims)
    config._attn_implementation = attn
    model = Qwen3_5ForCausalLM(config)
    mtp = TrainableMTP(config)
    with torch.no_grad():
        for module in mtp.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, config.initializer_range)
    return model, mtp


def load_models(ckpt_dir, *, attn: str = "sdpa") -> tuple[Qwen3_5ForCausalLM, TrainableMTP]:
    """Target + MTP head (fp32, eval) from a sharded checkpoint written by this script."""
    from safetensors.torch import load_file

    ckpt_dir = Path(ckpt_dir)
    index = json.loads((ckpt_dir / "model.safetensors.index.json").read_text())
    tensors = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(ckpt_dir / name)))
    config = Qwen3_5TextConfig.from_dict(json.loads((ckpt_dir / "config.json").read_text()))
    config._attn_implementation = attn
    model = Qwen3_5ForCausalLM(config).eval()
    mtp = TrainableMTP(config).eval()
    model.load_state_dict({k: v.float() for k, v in tensors.items() if not k.startswith("mtp.")}, strict=True)
    mtp.load_state_dict({k[len("mtp.") :]: v.float() for k, v in tensors.items() if k.startswith("mtp.")}, strict=True)
    return model, mtp


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ---------------------------------------------------------------------------------------------
# training


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


def make_optimizer(model, mtp, settings: TrainSettings, device: torch.device) -> torch.optim.AdamW:
    """Weight decay on Linear weights only (not embeddings, norms, conv, A_log, dt_bias)."""
    decay, no_decay = [], []
    for module in [model, mtp]:
        for sub in module.modules():
            for name, param in sub.named_parameters(recurse=False):
                (decay if isinstance(sub, nn.Linear) and name == "weight" else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = device.type == "cuda"
    return torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def learning_rate(settings: TrainSettings, step: int, progress: float) -> float:
    """Linear warmup over warmup_steps, then cosine from lr to min_lr_ratio*lr as progress goes 0 -> 1."""
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
    return settings.lr * (settings.min_lr_ratio + (1 - settings.min_lr_ratio) * cosine)


def train(model, mtp, stream: torch.Tensor, settings: TrainSettings, device: torch.device, seed: int) -> dict:
    """Train until the wall-clock budget (or max_steps) is spent; returns the log."""
    model.train()
    mtp.train()
    optimizer = make_optimizer(model, mtp, settings, device)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    cuda = device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    tokens_per_step = settings.batch_size * settings.seq_len
    budget = settings.minutes * 60.0
    log: list[dict] = []
    sums = torch.zeros(3, device=device)  # target, mtp, total loss since the last log line
    step, start = 0, time.perf_counter()
    last_time, last_step = start, 0
    print(f"training: {tokens_per_step} tokens/step (batch {settings.batch_size} x {settings.seq_len}), "
          f"budget {settings.minutes:g} min" + (f", max {settings.max_steps} steps" if settings.max_steps else ""))
    while True:
        elapsed = time.perf_counter() - start
        if (settings.max_steps is not None and step >= settings.max_steps) or (elapsed >= budget and step > 0):
            break
        progress = elapsed / budget if budget > 0 else 1.0
        if settings.max_steps:
            progress = max(progress, step / settings.max_steps)
        lr = learning_rate(settings, step, progress)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = random_windows(stream, settings.batch_size, settings.seq_len + 1, generator)  # [B, L+1]
        with autocast:
            target_loss, mtp_loss = losses(model, mtp, batch, detach_mtp_hidden=settings.detach_mtp_hidden)
            loss = target_loss + settings.mtp_weight * mtp_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
        optimizer.step()
        sums += torch.stack([target_loss.detach(), mtp_loss.detach(), loss.detach()]).float()
        step += 1
        if step % settings.log_every == 0 or step == settings.max_steps or step == 1:
            means = (sums / (step - last_step)).tolist()  # syncs the device
            now = time.perf_counter()
            rate = (step - last_step) * tokens_per_step / (now - last_time)
            entry = dict(step=step, time_s=round(now - start, 2), lr=lr, loss=means[2], target_loss=means[0],
                         mtp_loss=means[1], grad_norm=float(grad_norm), tokens_per_s=round(rate, 1),
                         tokens=step * tokens_per_step)
            log.append(entry)
            if not math.isfinite(means[2]):
                raise FloatingPointError(f"loss is {means[2]} at step {step}: lower --lr or check the data")
            print(f"step {step:5d}  {entry['time_s']:7.1f}s  loss {means[2]:.4f}  target {means[0]:.4f}  "
                  f"mtp {means[1]:.4f}  lr {lr:.2e}  |g| {entry['grad_norm']:.2f}  {rate:,.0f} tok/s", flush=True)
            if step == 1:
                print("  (step 1 includes warm-up; tokens/s is steady from the next line on)")
            elif len(log) == 2 and settings.max_steps is None:
                projected = entry["tokens"] + rate * max(budget - (now - start), 0.0)
                print(f"  projected: ~{projected / 1e6:,.1f} M tokens in {settings.minutes:g} min "
                      f"(~{projected / stream.numel():.1f} epochs of the train split)")
            sums.zero_()
            last_time, last_step = now, step
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    steady = [e["tokens_per_s"] for e in log[1:]] or [e["tokens_per_s"] for e in log]
    summary = dict(steps=step, tokens=step * tokens_per_step, train_wall_s=round(wall, 2),
                   mean_tokens_per_s=round(step * tokens_per_step / wall, 1),
                   steady_tokens_per_s=round(sorted(steady)[len(steady) // 2], 1) if steady else None,
                   epochs=round(step * tokens_per_step / stream.numel(), 3))
    memory = ""
    if cuda:
        summary["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        memory = f", peak memory {summary['max_memory_allocated_gib']} GiB"
    print(f"trained {step} steps, {summary['tokens']:,} tokens ({summary['epochs']} epochs) in {wall:.1f} s: "
          f"{summary['mean_tokens_per_s']:,.0f} tokens/s{memory}")
    return dict(log=log, summary=summary)


# ---------------------------------------------------------------------------------------------
# evaluation


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


def evaluate(model, mtp, test_stream: torch.Tensor, settings: TrainSettings, seed: int, bytes_per_token: float) -> dict:
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


# ---------------------------------------------------------------------------------------------
# output


def write_sharded(tensors: dict[str, torch.Tensor], out_dir: Path, max_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """Name-ordered shards, each file <= max_bytes, + model.safetensors.index.json covering every key."""
    headroom = min(64 * 1024, max_bytes // 16)  # the safetensors JSON header
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > max_bytes - headroom:
            raise ValueError(f"{name} alone is {nbytes} bytes, more than a {max_bytes}-byte shard holds")
        if groups[-1] and size + nbytes > max_bytes - headroom:
            groups.append({})
            size = 0
        groups[-1][name] = tensor
        size += nbytes
    weight_map, paths = {}, []
    for i, part in enumerate(groups):
        file_name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        path = out_dir / file_name
        save_file(part, str(path), metadata={"format": "pt"})
        path.chmod(0o644)
        if path.stat().st_size > max_bytes:
            raise RuntimeError(f"{path} is {path.stat().st_size} bytes > {max_bytes}")
        weight_map.update(dict.fromkeys(part, file_name))
        paths.append(path)
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return paths


def write_checkpoint(model, mtp, tokenizer, out_dir: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    for stale in [*out_dir.glob("model*.safetensors"), out_dir / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    mtp_tensors = {k: v.detach().cpu() for k, v in mtp.tensors().items()}
    tensors = checkpoint_tensors(model.cpu(), mtp_tensors, nested=False, dtype="float16")
    paths = write_sharded(tensors, out_dir, max_shard_bytes)
    write_config(model.config, out_dir, nested=False)
    write_generation_config(model.config, out_dir)
    write_tokenizer(tokenizer, out_dir, model.config.max_position_embeddings)
    return paths


@torch.no_grad()
def round_to_float16_(*modules: nn.Module) -> None:
    """Make the in-memory weights equal what the float16 checkpoint stores."""
    for module in modules:
        for param in module.parameters():
            param.copy_(param.to(torch.float16).float())


# ---------------------------------------------------------------------------------------------
# entry point


def settings_from_args(args, device: torch.device) -> TrainSettings:
    cuda = device.type == "cuda"
    if args.smoke:
        defaults = dict(seq_len=64, batch_size=4, max_steps=20, warmup_steps=2, log_every=5, eval_tokens=2048,
                        eval_chains=16, eval_batch=8)
    else:
        defaults = dict(seq_len=512, batch_size=64 if cuda else 2, max_steps=None, warmup_steps=100 if cuda else 2,
                        log_every=25 if cuda else 1, eval_tokens=1 << 20 if cuda else 2048,
                        eval_chains=1024 if cuda else 8, eval_batch=128 if cuda else 4)
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else defaults[name]  # noqa: E731
    return TrainSettings(
        seq_len=pick("seq_len"), batch_size=pick("batch_size"), minutes=args.minutes, max_steps=pick("max_steps"),
        lr=args.lr if args.lr is not None else (3e-3 if args.smoke else 1.5e-3), min_lr_ratio=0.1,
        warmup_steps=pick("warmup_steps"), weight_decay=0.1, grad_clip=1.0, mtp_weight=MTP_WEIGHT,
        detach_mtp_hidden=args.detach_mtp_hidden, log_every=pick("log_every"), eval_tokens=pick("eval_tokens"),
        eval_chains=pick("eval_chains"), eval_batch=pick("eval_batch"),
    )  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--minutes", type=float, default=8.0, help="training wall-clock budget (default 8)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available; --smoke: cpu)")
    parser.add_argument("--smoke", action="store_true", help="tiny config, 20 steps, small corpus slice (CI)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=None, help="default 64 on CUDA, 2 on CPU, 4 with --smoke")
    parser.add_argument("--seq-len", type=int, default=None, help="default 512 (--smoke: 64)")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (--smoke: 20)")
    parser.add_argument("--warmup-steps", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1.5e-3)")
    parser.add_argument("--log-every", type=int, default=None)
    parser.add_argument("--eval-tokens", type=int, default=None,
                        help="held-out tokens for the loss (default 1M on CUDA: all of it)")
    parser.add_argument("--eval-chains", type=int, default=None, help="greedy chains for MTP acceptance (default 1024)")
    parser.add_argument("--eval-batch", type=int, default=None)
    parser.add_argument("--max-corpus-mb", type=float, default=None,
                        help="stop reading sources after this many MiB (default 64; --smoke 1.5)")
    parser.add_argument("--site-packages", action="store_true", help="also read purelib *.py after the stdlib")
    parser.add_argument("--max-shard-mib", type=float, default=None,
                        help="largest safetensors file (default 15; --smoke 0.6, so that CI sees several shards)")
    parser.add_argument("--detach-mtp-hidden", action="store_true", help="stop MTP gradients at the target hidden h[t]")
    parser.add_argument("--compile", action="store_true", help="torch.compile the target trunk and the MTP head")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.perf_counter()
    device = torch.device(args.device or ("cpu" if args.smoke or not torch.cuda.is_available() else "cuda"))
    settings = settings_from_args(args, device)
    out_dir = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    # 1-2. corpus and tokenizer
    max_mb = args.max_corpus_mb if args.max_corpus_mb is not None else (1.5 if args.smoke else 64.0)
    corpus = read_corpus(int(max_mb * 2**20), site_packages=args.site_packages)
    if not corpus.train or not corpus.test:
        raise SystemExit(f"corpus too small: {corpus.train_files} train / {corpus.test_files} test files; "
                         "raise --max-corpus-mb")
    t_read = time.perf_counter()
    tokenizer = train_tokenizer(corpus.train)
    t_tok = time.perf_counter()
    train_stream, test_stream = token_stream(tokenizer, corpus.train), token_stream(tokenizer, corpus.test)
    t_enc = time.perf_counter()
    test_bytes = sum(len(t.encode()) for t in corpus.test)
    train_bytes = sum(len(t.encode()) for t in corpus.train)
    print(f"corpus: {corpus.train_files} train files ({train_bytes / 2**20:.1f} MiB, {train_stream.numel():,} tokens), "
          f"{corpus.test_files} test files ({test_bytes / 2**20:.2f} MiB, {test_stream.numel():,} tokens), "
          f"{corpus.skipped_files} skipped (not UTF-8); read {t_read - t0:.1f} s, BPE {t_tok - t_read:.1f} s, "
          f"encode {t_enc - t_tok:.1f} s")
    if test_stream.numel() < settings.seq_len + 2:
        raise SystemExit(f"held-out split has {test_stream.numel()} tokens < seq_len {settings.seq_len}; "
                         "raise --max-corpus-mb")

    # 3. model + training
    dims = SMOKE_MODEL if args.smoke else FULL_MODEL
    model, mtp = build_models(dims, seed=args.seed)
    print(f"model: {count_parameters(model) / 1e6:.2f} M target parameters + {count_parameters(mtp) / 1e6:.2f} M MTP; "
          f"layers {''.join('L' if t == LINEAR else 'F' for t in model.config.layer_types)}, device {device}")
    model.to(device)
    mtp.to(device)
    if args.compile:
        model.model = torch.compile(model.model)
        mtp = torch.compile(mtp)
    result = train(model, mtp, train_stream.to(device), settings, device, args.seed)
    if args.compile:
        model.model = model.model._orig_mod
        mtp = mtp._orig_mod

    # 4. evaluation of exactly what is saved
    round_to_float16_(model, mtp)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    evaluation = evaluate(model, mtp, test_stream.to(device), settings, args.seed,
                          bytes_per_token=test_bytes / test_stream.numel())
    print(format_eval(evaluation))

    # 5. output
    shard_mib = args.max_shard_mib if args.max_shard_mib is not None else (0.6 if args.smoke else 15.0)
    paths = write_checkpoint(model, mtp, tokenizer, out_dir, int(shard_mib * 2**20))
    evaluation.update(train_tokens=result["summary"]["tokens"], corpus=dict(
        sources=corpus.sources, train_files=corpus.train_files, test_files=corpus.test_files,
        skipped_files=corpus.skipped_files, train_tokens=train_stream.numel(), test_tokens=test_stream.numel(),
        train_bytes=train_bytes, test_bytes=test_bytes))
    (out_dir / "eval.json").write_text(json.dumps(evaluation, indent=2) + "\n")
    train_log = dict(
        args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        settings=asdict(settings), model=dict(dims, layer_types=list(dims["layer_types"])),
        parameters=dict(target=count_parameters(model), mtp=count_parameters(mtp)),
        device=str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        versions=dict(python=sys.version.split()[0], torch=torch.__version__, transformers=_transformers_version()),
        threads=torch.get_num_threads(), cpu_count=os.cpu_count(),
        timings_s=dict(read=round(t_read - t0, 2), bpe=round(t_tok - t_read, 2), encode=round(t_enc - t_tok, 2),
                       train=result["summary"]["train_wall_s"], eval=evaluation["eval_wall_s"]),
        summary=result["summary"], log=result["log"],
    )  # fmt: skip
    train_log["timings_s"]["total"] = round(time.perf_counter() - t0, 2)
    (out_dir / "train_log.json").write_text(json.dumps(train_log, indent=2) + "\n")
    size = sum(p.stat().st_size for p in paths)
    print(f"wrote {out_dir}: {len(paths)} shards ({size / 2**20:.1f} MiB, largest "
          f"{max(p.stat().st_size for p in paths) / 2**20:.2f} MiB); total {train_log['timings_s']['total']:.1f} s")
    return evaluation


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    main()
