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
out/qwen35-python-20m --minutes 6.5 --device cuda --site-packages --max-corpus-mb 200` (how
models/qwen35-python-20m was made). Total wall time = --minutes + corpus and tokenizer
(20 s on 2 CPU cores, less on 16) + evaluation and saving (estimated < 1 min on the H200).
--compile (torch.compile of trunk and MTP head) is optional; its compile time counts against
--minutes.

This file holds the model, the training loop and the entry point; the corpus and tokenizer, the
objective, the evaluation and the checkpoint writer live in tools/training/.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding  # noqa: E402

from tools.make_tiny_checkpoint import FULL, LINEAR, MTPHead, build_config, mtp_layer_config  # noqa: E402
from tools.training.checkpoint import round_to_float16_, write_checkpoint  # noqa: E402
from tools.training.corpus import VOCAB_SIZE, read_corpus, token_stream, train_tokenizer  # noqa: E402
from tools.training.evaluation import evaluate, format_eval  # noqa: E402
from tools.training.objective import losses, random_windows  # noqa: E402

MTP_WEIGHT = 0.5

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
