"""Write a tiny random Qwen3.5-text hybrid checkpoint (GDN + full attention + MTP) for tests.

    python tools/make_tiny_checkpoint.py OUT_DIR --seed 0 --preset small --tokenizer

The checkpoint looks like a published one, only small:

    OUT_DIR/config.json                     Qwen3_5TextConfig (model_type qwen3_5_text), or with
                                            --nested the multimodal wrapper (model_type qwen3_5,
                                            the text config under "text_config")
    OUT_DIR/model.safetensors               model.* (--nested: model.language_model.*), lm_head.weight
                                            (absent when tied), mtp.* (HF drops these on load)
    OUT_DIR/model-0000i-of-0000N.safetensors + model.safetensors.index.json   with --shards N
    OUT_DIR/generation_config.json
    OUT_DIR/tokenizer.json, tokenizer_config.json                             with --tokenizer

Every parameter is drawn from a seeded torch.Generator and differs from HF's default init, so a
converter that gets an offset norm (x̂·(1+w)), the GDN gated norm (x̂·w·silu(z)), the q/gate
interleave or A_log/dt_bias wrong produces different logits. Same arguments → byte-identical files.

MTP layout (published Qwen3.5; vLLM's Qwen3_5MultiTokenPredictor):

    e = pre_fc_norm_embedding(embed(x[t+1]))      [H]
    h = pre_fc_norm_hidden(h_t)                   [H]   h_t: target's final-normed hidden state
    x = fc(concat(e, h))                          mtp.fc.weight [H, 2H], embedding half first
    x = layers.0(x)                               a full-attention decoder layer, own KV cache
    logits = lm_head(norm(x))                     lm_head shared with the target
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5DecoderLayer,
    Qwen3_5GatedDeltaNet,
    Qwen3_5RMSNorm,
    Qwen3_5RMSNormGated,
)

LINEAR, FULL = "linear_attention", "full_attention"

DEFAULTS = dict(
    hidden_size=64, intermediate_size=128, vocab_size=512,
    layer_types=(LINEAR, LINEAR, LINEAR, FULL),
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, partial_rotary_factor=0.25, rope_theta=10000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, max_position_embeddings=4096,
)  # fmt: skip

# Presets override DEFAULTS; CLI flags override presets.
PRESETS: dict[str, dict] = {
    # The make_checkpoint() defaults: fastest, for unit tests.
    "tiny": {},
    # What models/tiny-qwen35 ships (~5 MB fp32).
    "small": dict(
        hidden_size=128, intermediate_size=384, vocab_size=1024,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    ),  # fmt: skip
    # Two full-attention layers (two KV caches), 8 layers.
    "deep": dict(layer_types=(LINEAR, LINEAR, LINEAR, FULL) * 2),
    # No head grouping anywhere (kv heads == heads, GDN k heads == v heads), half rotary, tied lm_head.
    "flat": dict(
        num_key_value_heads=4, linear_num_key_heads=4, linear_num_value_heads=4,
        partial_rotary_factor=0.5, tie_word_embeddings=True,
    ),  # fmt: skip
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Logit scale: lm_head rows ~ N(0, LM_HEAD_GAIN² / H) on a final-normed hidden state (RMS ≈ 1) give
# logits with std ≈ LM_HEAD_GAIN, i.e. clear top-1/top-2 gaps for greedy-equality tests.
LM_HEAD_GAIN = 4.0
# dt_bias ~ N(DT_BIAS_MEAN, 1). With mean 0, softplus(a + dt_bias)·exp(A_log) puts the median
# per-token GDN decay exp(g) near 0.003: the recurrent state would forget everything within one
# token and state bugs would not reach the logits. Mean −3 gives a median decay ≈ 0.7.
DT_BIAS_MEAN = -3.0


# ---------------------------------------------------------------------------------------------
# config


def build_config(*, mtp: bool = True, dtype: str = "float32", **overrides) -> Qwen3_5TextConfig:
    """A Qwen3_5TextConfig from DEFAULTS + overrides (any make_checkpoint dimension).

    rope_theta and partial_rotary_factor go into `rope_parameters` (transformers 5.x reads them only
    from there; left out, partial_rotary_factor silently defaults to 0.25).
    """
    unknown = set(overrides) - set(DEFAULTS) - {"bos_token_id", "eos_token_id", "pad_token_id"}
    if unknown:
        raise TypeError(f"unknown checkpoint options {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    dims = {**DEFAULTS, **overrides}
    layer_types = [_layer_type(t) for t in dims.pop("layer_types")]
    rope_parameters = {
        "rope_type": "default",
        "rope_theta": float(dims.pop("rope_theta")),
        "partial_rotary_factor": float(dims.pop("partial_rotary_factor")),
    }
    config = Qwen3_5TextConfig(
        num_hidden_layers=len(layer_types), layer_types=layer_types, rope_parameters=rope_parameters, **dims
    )
    if mtp:
        config.mtp_num_hidden_layers = 1
    config.architectures = ["Qwen3_5ForCausalLM"]
    config.dtype = dtype
    return config


def _layer_type(t: str) -> str:
    short = {"l": LINEAR, "linear": LINEAR, LINEAR: LINEAR, "f": FULL, "full": FULL, FULL: FULL}
    if t.lower() not in short:
        raise ValueError(f"layer type {t!r}: use linear_attention/full_attention (or L/F)")
    return short[t.lower()]


def mtp_layer_config(config: Qwen3_5TextConfig) -> Qwen3_5TextConfig:
    """The config for the MTP decoder layer: the target's, with one full-attention layer."""
    layer_config = copy.deepcopy(config)
    layer_config.layer_types = [FULL]
    layer_config.num_hidden_layers = 1
    return layer_config


# ---------------------------------------------------------------------------------------------
# weights


class MTPHead(nn.Module):
    """Only names and shapes: the `mtp.*` parameters of a published Qwen3.5 checkpoint."""

    def __init__(self, config: Qwen3_5TextConfig):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)  # [H, 2H]: concat(embedding, hidden)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, eps=eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(mtp_layer_config(config), 0)])
        self.norm = Qwen3_5RMSNorm(hidden, eps=eps)


@torch.no_grad()
def randomize_(module: nn.Module, generator: torch.Generator, *, lm_head: nn.Linear | None = None) -> None:
    """Overwrite every parameter of `module`, in name order, with draws from `generator`.

    Linear ~ N(0, 1/fan_in) (lm_head: LM_HEAD_GAIN²/fan_in), Embedding ~ N(0, 1), offset RMSNorm w ~ U(-0.5, 0.5)
    (used as 1+w), GDN gated-norm w ~ U(0.5, 1.5), conv1d ~ N(0, 0.5²), A_log = log U(1, 16),
    dt_bias ~ N(DT_BIAS_MEAN, 1). Raises if a parameter has no rule (a new HF parameter kind).
    """
    owners = {}
    for module_name, sub in module.named_modules():
        for param_name, _ in sub.named_parameters(recurse=False):
            owners[f"{module_name}.{param_name}".lstrip(".")] = sub
    for name, param in sorted(module.named_parameters(), key=lambda item: item[0]):
        param.copy_(_draw(name, param, owners[name], generator, is_lm_head=owners[name] is lm_head))


def _draw(name: str, param: torch.Tensor, owner: nn.Module, g: torch.Generator, *, is_lm_head: bool) -> torch.Tensor:
    shape = param.shape
    leaf = name.rsplit(".", 1)[-1]
    if isinstance(owner, Qwen3_5GatedDeltaNet) and leaf == "A_log":
        return torch.empty(shape).uniform_(1.0, 16.0, generator=g).log()
    if isinstance(owner, Qwen3_5GatedDeltaNet) and leaf == "dt_bias":
        return torch.randn(shape, generator=g) + DT_BIAS_MEAN
    if isinstance(owner, Qwen3_5RMSNorm):
        return torch.empty(shape).uniform_(-0.5, 0.5, generator=g)
    if isinstance(owner, Qwen3_5RMSNormGated):
        return torch.empty(shape).uniform_(0.5, 1.5, generator=g)
    if isinstance(owner, nn.Conv1d):
        return torch.randn(shape, generator=g) * 0.5
    if isinstance(owner, nn.Embedding):
        return torch.randn(shape, generator=g)
    if isinstance(owner, nn.Linear) and leaf == "weight":
        gain = LM_HEAD_GAIN if is_lm_head else 1.0
        return torch.randn(shape, generator=g) * (gain / math.sqrt(shape[1]))
    raise TypeError(f"make_tiny_checkpoint has no random rule for {name} ({type(owner).__name__}): add one")


def build_model(
    *, seed: int = 0, mtp: bool = True, dtype: str = "float32", draft_agreement: float = 0.0, **config_kwargs
) -> tuple[Qwen3_5ForCausalLM, dict[str, torch.Tensor]]:
    """The in-memory target model (fp32, eval, eager attention) and the `mtp.*` tensors.

    With dtype bfloat16/float16 every weight is rounded through that dtype, so the fp32 model equals
    what the saved checkpoint holds. Same arguments → same tensors. draft_agreement: see
    add_draft_agreement_ (0 leaves the weights exactly as without it).
    """
    config = build_config(mtp=mtp, dtype=dtype, **config_kwargs)
    config._attn_implementation = "eager"
    generator = torch.Generator().manual_seed(seed)
    with torch.device("cpu"):
        model = Qwen3_5ForCausalLM(config).eval()
    randomize_(model, generator, lm_head=None if config.tie_word_embeddings else model.lm_head)
    mtp_tensors = {}
    if mtp:
        head = MTPHead(config)
        randomize_(head, generator)
        mtp_tensors = {f"mtp.{k}": v.detach().clone() for k, v in head.state_dict().items()}
    if draft_agreement:
        add_draft_agreement_(model, mtp_tensors, draft_agreement, generator)
    with torch.no_grad():
        for tensor in [*model.parameters(), *mtp_tensors.values()]:
            tensor.copy_(tensor.to(DTYPES[dtype]).float())
    return model, mtp_tensors


@torch.no_grad()
def add_draft_agreement_(
    model: Qwen3_5ForCausalLM, mtp_tensors: dict[str, torch.Tensor], strength: float, generator: torch.Generator
) -> None:
    """Make MTP drafts often match the target, so speculative tests see every accepted length.

    With independent random weights a draft matches the target's argmax with chance ≈ 1/V: every
    step accepts 0 drafts. This mixes one shared random bigram map π (a permutation, drawn after all
    other weights) into both predictors:

        lm_head.weight[π(x)]  += strength · LM_HEAD_GAIN / H · embed[x]     the target (and the MTP,
                                                                            which shares lm_head) leans
                                                                            towards "x is followed by π(x)"
        mtp.fc.weight[:, :H]  += strength / 10 · I                          the MTP's output keeps the
                                                                            direction of embed(x[t+1])

    so d1 ≈ π(x[T]), d2 ≈ π(d1), ... and the target follows π only part of the time. Measured on
    greedy continuations, seed 0, strength 10: "small" preset (models/tiny-qwen35) → the first draft
    matches the target ≈ 57% of the time, and with k = 3 every accepted length 0..3 occurs; "tiny"
    → ≈ 35-45%. Every parameter stays random; only lm_head and mtp.fc gain the structure.
    """
    if model.config.tie_word_embeddings:
        raise ValueError(
            "draft_agreement needs an untied lm_head: pass tie_word_embeddings=False (--no-tie-word-embeddings)"
        )
    if "mtp.fc.weight" not in mtp_tensors:
        raise ValueError("draft_agreement needs the MTP weights: drop mtp=False (--no-mtp)")
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    perm = torch.randperm(vocab, generator=generator)  # π: token x is followed by perm[x]
    bigram = torch.zeros(vocab, hidden)
    bigram[perm] = model.model.embed_tokens.weight  # row π(x) = embed[x]
    model.lm_head.weight += strength * LM_HEAD_GAIN / hidden * bigram
    mtp_tensors["mtp.fc.weight"][:, :hidden] += strength / 10 * torch.eye(hidden)


def checkpoint_tensors(
    model: Qwen3_5ForCausalLM, mtp_tensors: dict[str, torch.Tensor], *, nested: bool, dtype: str
) -> dict[str, torch.Tensor]:
    """Name → tensor as stored, in name order.

    A tied lm_head is left out (as HF saves it); nested renames `model.` → `model.language_model.`.
    """
    tensors = {}
    for name, tensor in model.state_dict().items():
        if "rotary_emb" in name or (name == "lm_head.weight" and model.config.tie_word_embeddings):
            continue
        if nested and name.startswith("model."):
            name = "model.language_model." + name[len("model.") :]
        tensors[name] = tensor
    tensors.update(mtp_tensors)
    return {name: t.detach().to(DTYPES[dtype]).contiguous().clone() for name, t in sorted(tensors.items())}


# ---------------------------------------------------------------------------------------------
# files


def write_safetensors(tensors: dict[str, torch.Tensor], out_dir: Path, shards: int) -> list[Path]:
    """model.safetensors, or `shards` files split in name order plus model.safetensors.index.json."""
    if shards <= 1:
        path = out_dir / "model.safetensors"
        save_file(tensors, str(path), metadata={"format": "pt"})
        path.chmod(0o644)  # safetensors creates 0600
        return [path]
    names = list(tensors)
    if shards > len(names):
        raise ValueError(f"--shards {shards} exceeds the {len(names)} tensors of this checkpoint")
    bounds = [round(i * len(names) / shards) for i in range(shards + 1)]
    weight_map, paths = {}, []
    for i in range(shards):
        file_name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[bounds[i] : bounds[i + 1]]}
        save_file(part, str(out_dir / file_name), metadata={"format": "pt"})
        (out_dir / file_name).chmod(0o644)
        weight_map.update(dict.fromkeys(part, file_name))
        paths.append(out_dir / file_name)
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return paths


def write_config(config: Qwen3_5TextConfig, out_dir: Path, *, nested: bool) -> dict:
    """config.json; nested: the multimodal wrapper a published Qwen3.5 ships (no vision_config)."""
    text = config.to_diff_dict()
    text.pop("transformers_version", None)
    if nested:
        text.pop("architectures", None)
        body = {
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5",
            "text_config": text,
            "tie_word_embeddings": config.tie_word_embeddings,
        }
    else:
        body = text
    (out_dir / "config.json").write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
    return body


def write_generation_config(config: Qwen3_5TextConfig, out_dir: Path) -> None:
    """Greedy by default; the special token ids when the checkpoint has a tokenizer."""
    generation = {"do_sample": False}
    if config.eos_token_id is not None:
        generation.update(eos_token_id=config.eos_token_id, pad_token_id=config.eos_token_id)
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------------------------
# tokenizer

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

_CORPUS = """\
ortspec converts hybrid checkpoints into ONNX graphs and decodes them with ONNX Runtime.
A gated delta rule layer keeps a recurrent state; a full attention layer keeps a key value cache.
The draft head proposes tokens, the target verifies them, and the longest matching prefix is kept.
Every state is committed as if the accepted tokens had been decoded one by one.
def greedy(session, prompt, max_new_tokens=16):
    tokens = list(prompt)
    for step in range(max_new_tokens):
        logits = session.forward(tokens[-1], position=len(tokens) - 1)
        tokens.append(int(logits.argmax()))
    return tokens
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs!
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 31 42 64 128 256 512 1024 2048 4096
"""

_WORDS = (
    "the a of to and in is it for on with as by at from that this be are was not or but if then "
    "else return def class import self none true false state cache token draft target verify accept "
    "commit layer head hidden norm gate weight value key query position batch step graph session "
    "model input output shape float int list dict time data file path test run error check"
).split()


def tokenizer_corpus() -> str:
    """A built-in, Python-version-independent training text (~30 kB)."""
    rng = random.Random(0)
    lines = [_CORPUS]
    for i in range(600):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
        lines.append(f"{words}. x_{i % 23} = f({i * 7 % 101}, {rng.randint(0, 9999)})")
    return "\n".join(lines)


def write_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A byte-level BPE of `vocab_size` tokens (ids 0..2 are the special tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"--tokenizer needs vocab_size >= {256 + len(SPECIAL_TOKENS)} (byte alphabet)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([tokenizer_corpus()], trainer=trainer)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "eos_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[0],
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------------------------
# entry points


def make_checkpoint(
    out_dir, *, seed=0, hidden_size=64, intermediate_size=128, vocab_size=512,
    layer_types=(LINEAR, LINEAR, LINEAR, FULL), num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, partial_rotary_factor=0.25,
    rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, mtp=True,
    max_position_embeddings=4096, nested=False, shards=1, tokenizer=False, dtype="float32",
    draft_agreement=0.0,
) -> Path:  # fmt: skip
    """Write a random checkpoint to `out_dir` (created; existing checkpoint files overwritten)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: use one of {sorted(DTYPES)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*out_dir.glob("model*.safetensors"), out_dir / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    dims = dict(
        hidden_size=hidden_size, intermediate_size=intermediate_size, vocab_size=vocab_size,
        layer_types=tuple(layer_types), num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, head_dim=head_dim,
        linear_num_key_heads=linear_num_key_heads, linear_num_value_heads=linear_num_value_heads,
        linear_key_head_dim=linear_key_head_dim, linear_value_head_dim=linear_value_head_dim,
        linear_conv_kernel_dim=linear_conv_kernel_dim, partial_rotary_factor=partial_rotary_factor,
        rope_theta=rope_theta, rms_norm_eps=rms_norm_eps, tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
    )  # fmt: skip
    if tokenizer:
        dims.update(eos_token_id=0)  # <|endoftext|>
    model, mtp_tensors = build_model(seed=seed, mtp=mtp, dtype=dtype, draft_agreement=draft_agreement, **dims)
    write_safetensors(checkpoint_tensors(model, mtp_tensors, nested=nested, dtype=dtype), out_dir, shards)
    write_config(model.config, out_dir, nested=nested)
    write_generation_config(model.config, out_dir)
    if tokenizer:
        write_tokenizer(out_dir, vocab_size)
    return out_dir


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--nested", action="store_true", help="multimodal-style config + model.language_model.* keys")
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--tokenizer", action="store_true", help="also train and write a byte-level BPE tokenizer.json")
    parser.add_argument("--no-mtp", dest="mtp", action="store_false", help="leave out mtp.* weights")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument(
        "--draft-agreement", type=float, default=0.0,
        help="bias lm_head and mtp.fc towards a shared random bigram map so that drafts often get "
        "accepted (10: ~57%% of first drafts on the small preset); 0 = independent random weights",
    )  # fmt: skip
    parser.add_argument("--layer-types", help="comma list or letters, e.g. LLLF or linear_attention,full_attention")
    for name, value in DEFAULTS.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            parser.add_argument("--" + name.replace("_", "-"), dest=name, type=type(value), default=None)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = _parse_args(argv)
    kwargs = dict(PRESETS[args.preset])
    for name in DEFAULTS:
        if getattr(args, name, None) is not None:
            kwargs[name] = getattr(args, name)
    if args.layer_types:
        kinds = args.layer_types.split(",") if "," in args.layer_types else list(args.layer_types)
        kwargs["layer_types"] = tuple(_layer_type(t) for t in kinds)
    out = make_checkpoint(
        args.out_dir, seed=args.seed, mtp=args.mtp, nested=args.nested, shards=args.shards,
        tokenizer=args.tokenizer, dtype=args.dtype, draft_agreement=args.draft_agreement, **kwargs,
    )  # fmt: skip
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out} ({size / 2**20:.2f} MiB): {', '.join(sorted(p.name for p in out.iterdir()))}")


if __name__ == "__main__":
    main()
