"""Tests of the checkpoint tool (tools/make_tiny_checkpoint.py) and of the MTP reference itself.

The reference is what converter and runtime tests compare against, so it is checked here against
an independent hand-written MTP forward (including the per-head [query | gate] interleave of q_proj)
and against transformers' own model. All fast: tiny checkpoints, short sequences.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import reference_mtp as ref  # noqa: E402
from tools import make_tiny_checkpoint as mk  # noqa: E402
from transformers import AutoConfig  # noqa: E402
from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM  # noqa: E402
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer  # noqa: E402

SHIPPED = ROOT / "models" / "tiny-qwen35"
# The exact command models/README.md documents (the CLI minus the output directory).
SHIPPED_ARGS = ["--seed", "0", "--preset", "small", "--tokenizer", "--draft-agreement", "10"]


# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Checkpoints of one tiny model (seed 5) in every layout, plus a tied and an MTP-less one."""

    def make(name, **kwargs):
        return mk.make_checkpoint(tmp_path_factory.mktemp(name), seed=5, **kwargs)

    return {
        "flat": make("flat"),
        "nested": make("nested", nested=True),
        "sharded": make("sharded", shards=3),
        "tied": make("tied", tie_word_embeddings=True),
        "bf16": make("bf16", dtype="bfloat16"),
        "no_mtp": make("no_mtp", mtp=False),
    }


def tensors_of(ckpt_dir) -> dict[str, torch.Tensor]:
    return ref.load_tensors(ckpt_dir)


def hf_logits(ckpt_dir, ids, **kwargs) -> torch.Tensor:
    model = Qwen3_5ForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32, attn_implementation="eager", **kwargs)
    with torch.no_grad():
        return model.eval()(ids).logits


def random_ids(vocab, n, seed=0) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# the tool


def test_every_parameter_randomized(ckpts):
    """No tensor keeps HF's default init: no constant norm weights, A_log/dt_bias redrawn, std not 0.02."""
    tensors = tensors_of(ckpts["flat"])
    config = ref.load_text_config(ckpts["flat"])
    torch.manual_seed(5)
    default = Qwen3_5ForCausalLM(config).state_dict()
    for name, t in tensors.items():
        assert t.unique().numel() > 1, f"{name} is constant"
        if name in default:
            assert not torch.equal(t, default[name]), f"{name} equals the default init"
        if name.endswith("linear_attn.norm.weight"):  # gated RMSNorm, plain w
            assert 0.5 <= t.min() and t.max() <= 1.5
        elif name.endswith("norm.weight"):  # offset RMSNorm, 1 + w
            assert -0.5 <= t.min() < 0 < t.max() <= 0.5, name
        elif name.endswith("A_log"):
            assert 0.0 <= t.min() and t.max() <= torch.log(torch.tensor(16.0))
        elif name.endswith("dt_bias"):
            assert t.mean() < -1.0  # shifted so GDN states remember (see DT_BIAS_MEAN)
        elif name.endswith("proj.weight") or name == "mtp.fc.weight":
            assert abs(t.std() * t.shape[1] ** 0.5 - 1.0) < 0.25, name  # N(0, 1/fan_in), not 0.02
    mtp_names = {n for n in tensors if n.startswith("mtp.")}
    layer3 = {n[len("model.layers.3.") :] for n in tensors if n.startswith("model.layers.3.")}
    assert mtp_names == {
        "mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
        *(f"mtp.layers.0.{n}" for n in layer3),
    }  # fmt: skip
    for n in layer3:  # same names and shapes as the target's full-attention layer, different values
        assert tensors[f"mtp.layers.0.{n}"].shape == tensors[f"model.layers.3.{n}"].shape
        assert not torch.equal(tensors[f"mtp.layers.0.{n}"], tensors[f"model.layers.3.{n}"])
    assert tensors["mtp.fc.weight"].shape == (64, 128)
    assert tensors["mtp.layers.0.self_attn.q_proj.weight"].shape == (4 * 16 * 2, 64)


def test_hf_loads_checkpoint_and_reproduces_in_memory_logits(ckpts):
    model, _ = mk.build_model(seed=5)
    ids = random_ids(512, 24)[None]
    with torch.no_grad():
        expected = model(ids).logits
    loaded, info = Qwen3_5ForCausalLM.from_pretrained(
        ckpts["flat"], dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]  # mtp.* are dropped silently
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, expected)
    top2 = expected[0].topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.2  # healthy top-1/top-2 gaps


def test_config_round_trips_rope_and_partial_rotary(tmp_path):
    mk.make_checkpoint(tmp_path, seed=1, partial_rotary_factor=0.5, rope_theta=5e5, head_dim=16)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5_text" and raw["architectures"] == ["Qwen3_5ForCausalLM"]
    assert raw["rope_parameters"] == {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5}
    assert raw["mtp_num_hidden_layers"] == 1 and "rope_theta" not in raw and "partial_rotary_factor" not in raw
    config = AutoConfig.from_pretrained(tmp_path)
    assert config.rope_parameters["partial_rotary_factor"] == 0.5 and config.rope_parameters["rope_theta"] == 5e5
    model = Qwen3_5ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    rotary = model.model.rotary_emb
    assert rotary.inv_freq.numel() == 16 * 0.5 / 2  # HF rotates head_dim · partial_rotary_factor dims
    cos, _ = rotary(torch.zeros(1), torch.arange(3)[None])
    assert cos.shape[-1] == 8


def test_sharded_index_is_complete(ckpts):
    index = json.loads((ckpts["sharded"] / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    stored = {}
    for name in files:
        with safe_open(str(ckpts["sharded"] / name), "pt") as f:
            stored.update({key: name for key in f.keys()})
    assert stored == index["weight_map"]
    single = tensors_of(ckpts["flat"])
    assert set(stored) == set(single) and any(k.startswith("mtp.") for k in stored)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in single.values())
    sharded = tensors_of(ckpts["sharded"])
    assert all(torch.equal(sharded[k], single[k]) for k in single)
    ids = random_ids(512, 12)[None]
    assert torch.equal(hf_logits(ckpts["sharded"], ids), hf_logits(ckpts["flat"], ids))


def test_same_seed_same_bytes_other_seed_other_bytes(ckpts, tmp_path):
    again = mk.make_checkpoint(tmp_path / "again", seed=5)
    other = mk.make_checkpoint(tmp_path / "other", seed=6)
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        assert (again / name).read_bytes() == (ckpts["flat"] / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()


def test_nested_layout(ckpts):
    raw = json.loads((ckpts["nested"] / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5" and raw["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert raw["text_config"]["model_type"] == "qwen3_5_text" and raw["tie_word_embeddings"] is False
    config = AutoConfig.from_pretrained(ckpts["nested"])
    assert isinstance(config, Qwen3_5Config) and config.text_config.hidden_size == 64
    nested, flat = tensors_of(ckpts["nested"]), tensors_of(ckpts["flat"])
    assert not any(k.startswith("model.") and not k.startswith("model.language_model.") for k in nested)
    renamed = {k.replace("model.language_model.", "model.", 1): v for k, v in nested.items()}
    assert renamed.keys() == flat.keys() and all(torch.equal(renamed[k], flat[k]) for k in flat)
    ids = random_ids(512, 12)[None]  # transformers 5.24 itself reads the nested layout as a causal LM
    assert torch.equal(hf_logits(ckpts["nested"], ids), hf_logits(ckpts["flat"], ids))


def test_tied_and_no_mtp_and_bf16(ckpts):
    tied = tensors_of(ckpts["tied"])
    assert "lm_head.weight" not in tied  # as HF saves a tied model
    model, _ = mk.build_model(seed=5, tie_word_embeddings=True)
    ids = random_ids(512, 10)[None]
    with torch.no_grad():
        assert torch.equal(hf_logits(ckpts["tied"], ids), model(ids).logits)
    assert not any(k.startswith("mtp.") for k in tensors_of(ckpts["no_mtp"]))
    assert "mtp_num_hidden_layers" not in json.loads((ckpts["no_mtp"] / "config.json").read_text())
    bf16 = tensors_of(ckpts["bf16"])
    assert {t.dtype for t in bf16.values()} == {torch.bfloat16}
    model, _ = mk.build_model(seed=5, dtype="bfloat16")  # fp32 copy of the rounded weights
    with torch.no_grad():
        assert torch.equal(hf_logits(ckpts["bf16"], ids), model(ids).logits)


def test_draft_agreement_only_touches_lm_head_and_fc():
    plain_model, plain_mtp = mk.build_model(seed=2)
    model, mtp = mk.build_model(seed=2, draft_agreement=10)
    plain, agreed = plain_model.state_dict(), model.state_dict()
    changed = {k for k in plain if not torch.equal(plain[k], agreed[k])}
    changed |= {k for k in plain_mtp if not torch.equal(plain_mtp[k], mtp[k])}
    assert changed == {"lm_head.weight", "mtp.fc.weight"}
    with pytest.raises(ValueError, match="untied"):
        mk.build_model(seed=2, tie_word_embeddings=True, draft_agreement=10)


def test_tokenizer(tmp_path):
    from tokenizers import Tokenizer

    mk.make_checkpoint(tmp_path, seed=0, vocab_size=400, tokenizer=True, mtp=False)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 400
    assert tokenizer.token_to_id("<|endoftext|>") == 0
    for text in ["Hello, world!", "def f(x):\n    return x * 2  # ok\n", "  spaces\tand ~`^ symbols 0123"]:
        ids = tokenizer.encode(text).ids
        assert max(ids) < 400 and tokenizer.decode(ids) == text
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["eos_token_id"] == 0
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"


def test_cli_preset_and_overrides(tmp_path):
    mk.main([str(tmp_path), "--seed", "3", "--preset", "deep", "--hidden-size", "32", "--layer-types", "LFLF",
             "--no-mtp"])  # fmt: skip
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["hidden_size"] == 32 and raw["num_hidden_layers"] == 4
    assert raw["layer_types"] == ["linear_attention", "full_attention"] * 2
    assert not any(k.startswith("mtp.") for k in tensors_of(tmp_path))


# ---------------------------------------------------------------------------------------------
# the reference


def manual_mtp_forward(tensors, config, input_ids, hidden, positions):
    """Independent re-derivation of the MTP forward from the raw tensors (no HF modules)."""
    eps, nh, nkv, hd = config.rms_norm_eps, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    rot = int(hd * config.rope_parameters["partial_rotary_factor"])
    theta = config.rope_parameters["rope_theta"]
    w = lambda name: tensors[name].float()  # noqa: E731

    def norm(x, name):  # offset RMSNorm
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w(name))

    def rope(x):  # x [heads, T, hd]: rotate the first `rot` dims, neox halves
        inv = 1.0 / theta ** (torch.arange(0, rot, 2).float() / rot)
        ang = positions.float()[:, None] * inv[None]  # [T, rot/2]
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        xr, xp = x[..., :rot], x[..., rot:]
        half = torch.cat([-xr[..., rot // 2 :], xr[..., : rot // 2]], -1)
        return torch.cat([xr * cos + half * sin, xp], -1)

    T = input_ids.numel()
    e = norm(w("model.embed_tokens.weight")[input_ids], "mtp.pre_fc_norm_embedding.weight")
    h = norm(hidden, "mtp.pre_fc_norm_hidden.weight")
    x = torch.cat([e, h], -1) @ w("mtp.fc.weight").T  # [T, H]
    p = "mtp.layers.0."
    y = norm(x, p + "input_layernorm.weight")
    qg = (y @ w(p + "self_attn.q_proj.weight").T).view(T, nh, 2 * hd)  # per head: [query | gate]
    q, gate = qg[..., :hd], qg[..., hd:].reshape(T, nh * hd)
    q = rope(norm(q, p + "self_attn.q_norm.weight").transpose(0, 1))  # [nh, T, hd]
    k = norm((y @ w(p + "self_attn.k_proj.weight").T).view(T, nkv, hd), p + "self_attn.k_norm.weight")
    k = rope(k.transpose(0, 1))  # [nkv, T, hd]
    v = (y @ w(p + "self_attn.v_proj.weight").T).view(T, nkv, hd).transpose(0, 1)
    k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
    scores = (q @ k.transpose(1, 2)) / hd**0.5 + torch.full((T, T), float("-inf")).triu(1)
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, nh * hd) * torch.sigmoid(gate)
    x = x + attn @ w(p + "self_attn.o_proj.weight").T
    y = norm(x, p + "post_attention_layernorm.weight")
    mlp = F.silu(y @ w(p + "mlp.gate_proj.weight").T) * (y @ w(p + "mlp.up_proj.weight").T)
    x = x + mlp @ w(p + "mlp.down_proj.weight").T
    out = norm(x, "mtp.norm.weight")
    return out @ w("lm_head.weight").T, out


def test_reference_matches_hand_written_mtp(ckpts):
    mtp = ref.MTPReference(ckpts["flat"])
    assert type(mtp.layer) is Qwen3_5DecoderLayer and mtp.layer.block_type == "full_attention"
    assert mtp.layer.self_attn.q_proj.weight.shape == (2 * 4 * 16, 64)
    tensors = tensors_of(ckpts["flat"])
    ids, hidden, positions = random_ids(512, 9, seed=1), torch.randn(9, 64), torch.arange(3, 12)
    logits, out = mtp.forward(ids, hidden, positions)
    assert logits.shape == (9, 512) and out.shape == (9, 64) and logits.dtype == torch.float32
    want_logits, want_out = manual_mtp_forward(tensors, mtp.config, ids, hidden, positions)
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-5)
    # A converter that splits q_proj as [all queries | all gates] instead of per head is caught:
    q_name = "mtp.layers.0.self_attn.q_proj.weight"
    q_w = tensors[q_name].view(4, 2, 16, 64)  # [head, (query, gate), hd, H]
    wrong = dict(tensors, **{q_name: q_w.transpose(0, 1).reshape(128, 64)})
    wrong_logits, _ = manual_mtp_forward(wrong, mtp.config, ids, hidden, positions)
    assert (wrong_logits - logits).abs().max() > 1e-2


def test_reference_is_causal_and_deterministic(ckpts):
    a, b = ref.MTPReference(ckpts["flat"]), ref.MTPReference(ckpts["flat"])
    ids, hidden = random_ids(512, 10, seed=2), torch.randn(10, 64)
    la, ha = a.forward(ids, hidden, torch.arange(10))
    lb, hb = b.forward(ids, hidden, torch.arange(10))
    assert torch.equal(la, lb) and torch.equal(ha, hb)
    l6, h6 = a.forward(ids[:6], hidden[:6], torch.arange(6))  # later rows never change earlier ones
    torch.testing.assert_close(l6, la[:6], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a.forward(ids, hidden, torch.arange(10) + 1)[0], la)  # rope is applied


def test_reference_lm_head_tied_and_untied(ckpts):
    tied = ref.MTPReference(ckpts["tied"])
    assert torch.equal(tied.lm_head, tied.embed)
    untied = ref.MTPReference(ckpts["flat"])
    assert torch.equal(untied.lm_head, tensors_of(ckpts["flat"])["lm_head.weight"])
    assert not torch.equal(untied.lm_head, untied.embed)
    logits, out = tied.forward(random_ids(512, 4), torch.randn(4, 64), torch.arange(4))
    torch.testing.assert_close(logits, out @ tied.embed.T)
    with pytest.raises(KeyError, match="no mtp"):
        ref.MTPReference(ckpts["no_mtp"])


@pytest.mark.parametrize("layout", ["nested", "sharded", "bf16"])
def test_reference_loads_every_layout(ckpts, layout):
    ids, hidden = random_ids(512, 7, seed=3), torch.randn(7, 64)
    flat = ref.MTPReference(ckpts["flat"]).forward(ids, hidden, torch.arange(7))
    other = ref.MTPReference(ckpts[layout]).forward(ids, hidden, torch.arange(7))
    tokens = random_ids(512, 8, seed=4)
    flat_t, other_t = ref.target_hidden_states(ckpts["flat"], tokens), ref.target_hidden_states(ckpts[layout], tokens)
    if layout == "bf16":  # same model up to bf16 rounding of the weights
        torch.testing.assert_close(other[0], flat[0], atol=0.3, rtol=0.05)
        torch.testing.assert_close(other_t[1], flat_t[1], atol=0.3, rtol=0.05)
    else:
        assert torch.equal(other[0], flat[0]) and torch.equal(other[1], flat[1])
        assert torch.equal(other_t[0], flat_t[0]) and torch.equal(other_t[1], flat_t[1])


def test_target_hidden_is_final_normed(ckpts):
    """HF's hidden_states[-1] is model.norm's output (normed), and lm_head of it is the logits."""
    tokens = random_ids(512, 11, seed=5)
    hidden, logits = ref.target_hidden_states(ckpts["flat"], tokens)
    model = ref.target_model(ckpts["flat"])
    captured = {}
    hook = model.model.norm.register_forward_hook(lambda m, i, o: captured.update(out=o))
    with torch.no_grad():
        hf = Qwen3_5ForCausalLM.from_pretrained(ckpts["flat"], dtype=torch.float32, attn_implementation="eager")
        hf_out = hf(tokens[None], output_hidden_states=True)
        model(tokens[None])
    hook.remove()
    assert len(hf_out.hidden_states) == 4 + 1
    assert torch.equal(hidden, captured["out"][0]) and torch.equal(hidden, hf_out.hidden_states[-1][0])
    assert torch.equal(logits, hf_out.logits[0]) and torch.equal(model.lm_head(hidden), logits)


def test_reference_drafts_follow_the_definition(ckpts):
    tokens = random_ids(512, 9, seed=6)  # x[0..8]: the target has seen x[0..7]
    drafts, draft_logits = ref.reference_drafts(ckpts["flat"], tokens, 3, return_logits=True)
    assert drafts.shape == (3,) and draft_logits.shape == (3, 512)
    assert torch.equal(ref.reference_drafts(ckpts["flat"], tokens, 1), drafts[:1])
    # by hand: one growing causal forward per draft
    target_hidden, _ = ref.target_hidden_states(ckpts["flat"], tokens[:-1])
    mtp = ref.MTPReference(ckpts["flat"])
    ids, hiddens = tokens[1:], target_hidden
    for j in range(3):
        logits, out = mtp.forward(ids, hiddens, torch.arange(len(ids)))
        assert int(logits[-1].argmax()) == int(drafts[j])
        ids, hiddens = torch.cat([ids, drafts[j : j + 1]]), torch.cat([hiddens, out[-1:]])


def test_shipped_checkpoint(tmp_path):
    files = sorted(p.name for p in SHIPPED.iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]  # fmt: skip
    assert sum((SHIPPED / f).stat().st_size for f in files) < 8 * 2**20
    mk.main([str(tmp_path), *SHIPPED_ARGS])  # the documented command reproduces it byte for byte
    for name in files:
        assert (tmp_path / name).read_bytes() == (SHIPPED / name).read_bytes(), f"{name}: regenerate models/"
    config = ref.load_text_config(SHIPPED)
    assert (config.hidden_size, config.vocab_size, config.mtp_num_hidden_layers) == (128, 1024, 1)
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
