"""What the GPU subcommands share: model paths and presets, prompt sets, model preparation,
identity checks, JSON output and markdown tables."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import ortspec
from ortspec.speculative.exactness import ExactnessError, check_speculative
from tools.make_tiny_checkpoint import FULL, LINEAR, make_checkpoint
from tools.stream_checkpoint import QWEN35_08B, write_random_checkpoint

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny-qwen35"
TRAINED = ROOT / "models" / "qwen35-python-20m"
STAGED_ORT = Path("/tmp/ortgpu")  # where .ortgpu/install.sh unpacks onnxruntime-gpu on the GPU host
HOST_OUT = Path(os.environ.get("OUT", "/tmp/out"))  # what the host script copies back

# A larger random model in the Qwen3.5 layout (3 GDN : 1 attention), 116M parameters: memory and speed.
MEDIUM = dict(hidden_size=1024, intermediate_size=2816, vocab_size=8192, num_attention_heads=8,
              num_key_value_heads=2, head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16,
              linear_key_head_dim=64, linear_value_head_dim=64,
              layer_types=(LINEAR, LINEAR, LINEAR, FULL) * 2)
# A random 0.9B model (1.0B with the MTP head): the memory-bound regime.
LARGE = dict(hidden_size=2048, intermediate_size=6144, vocab_size=32768, num_attention_heads=8,
             num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
             linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=True,
             layer_types=(LINEAR, LINEAR, LINEAR, FULL) * 3)
PRESETS = {"medium": (MEDIUM, dict(seed=7, draft_agreement=10.0)), "large": (LARGE, dict(seed=3))}
# Checkpoints of a real model's shape, written tensor by tensor (tools/stream_checkpoint.py), stored float16:
# Qwen3.5-0.8B's (hidden 1024, 24 layers, vocabulary 248,320, tied embeddings, one MTP layer).
STREAMED = {"qwen35-0.8b": (QWEN35_08B, dict(seed=0, dtype="float16"))}

# Prompt sets (token ids of the random models; text for the trained one).
IDENTITY_PROMPTS = [[5, 17, 99, 3, 250, 7, 11], [42], [8, 8, 8, 300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
                    [900, 1]]
STAGGERED_REQUESTS = [([5, 17, 99, 3, 250, 7, 11], 30), ([42], 45), ([8, 8, 8, 300, 1, 2, 3, 4, 5, 6, 7, 8, 9], 12),
                      ([1, 2], 25), ([400, 3, 3, 3], 40), ([77] * 20, 18)]  # (prompt, max_new_tokens)
SHORT_PROMPTS = [prompt for prompt, _ in STAGGERED_REQUESTS[:3]]
STEP_PROMPT = [11, 7, 3, 250, 99, 17, 5, 42]  # every row of a running batch, for per-step timings
CODE_PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self, text):",
                "for i in range(10):"]


ACTIVATIONS = "auto"  # convert's activations in every subcommand; tools/gpu.py --activations sets it


def convert(source, out, dtype: str = "float32", max_length: int = 512, pipeline_stages: int = 1,
            quant: str | None = None, gdn_verify: str = "auto", draft_vocab="auto") -> Path:
    """ortspec.convert with K=4, quietly, replacing an earlier conversion at the same fixed path
    (the subcommands reconvert into fixed /tmp paths): every subcommand converts this way, with
    the activations of ``--activations`` (int4 weights keep float32 ones: convert refuses "model")
    and convert's draft vocabulary (auto: 32768 tokens from a 65536-token vocabulary up)."""
    activations = ACTIVATIONS if quant is None else "float32"
    return ortspec.convert(source, out, num_speculative_tokens=4, max_length=max_length, dtype=dtype,
                           pipeline_stages=pipeline_stages, quant=quant, activations=activations,
                           gdn_verify=gdn_verify, draft_vocab=draft_vocab, overwrite=True, progress=False)


def random_checkpoint(out: Path, preset: str) -> Path:
    """A random checkpoint of MEDIUM, LARGE (fixed seeds) or a STREAMED shape in out."""
    if preset in STREAMED:
        config, options = STREAMED[preset]
        return write_random_checkpoint(out, **options, **config)
    config, options = PRESETS[preset]
    make_checkpoint(out, **options, **config)
    return out


class Budget:
    """A subcommand's time limit (--budget-s), counted from its start; 0 means none. Work is
    stopped between units (a generate call, a round), never inside one."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.start = seconds, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def spent(self, reserve: float = 0.0) -> bool:
        """True when the limit is passed, or would be after `reserve` more seconds."""
        return bool(self.seconds) and self.elapsed() + reserve > self.seconds


class Checks:
    """The identity checks of one run: counted (exit status 1 if any failed) and kept for the JSON."""

    def __init__(self) -> None:
        self.failures = 0
        self.results: dict = {}

    def record(self, name: str, ok: bool, value=None) -> bool:
        self.failures += not ok
        self.results[name] = ok if value is None else value
        return ok

    def fail(self, count: int = 1) -> None:
        self.failures += count

    def exit_status(self, label: str = "failures") -> int:
        print(f"{label}:", self.failures)
        return 1 if self.failures else 0


def speculative_matches_greedy(model, prompts, max_new_tokens: int, provider: str = "cuda", ks=(1, 2, 3, 4),
                               commits=("select", "readvance")) -> dict[tuple[str, int], bool]:
    """{(commit, k): speculative tokens == greedy tokens of the same model and provider}."""
    greedy = ortspec.Session(model, provider=provider).generate(prompts, max_new_tokens=max_new_tokens)
    return {(commit, k): ortspec.Session(model, provider=provider, num_speculative_tokens=k, commit=commit).generate(
                prompts, max_new_tokens=max_new_tokens) == greedy
            for commit in commits for k in ks}


def identity_lines(label: str, same: dict[tuple[str, int], bool]) -> str:
    """'LABEL select: speculative == greedy for k=1..4: [True, ...]', one line per commit."""
    commits = dict.fromkeys(commit for commit, _ in same)
    return "\n".join(f"{label} {commit}: speculative == greedy for k=1..4: "
                     f"{[ok for (c, _), ok in same.items() if c == commit]}" for commit in commits)


def bench_code_model(model, transformers_checkpoint=None) -> dict:
    """The bench of the trained-model runs: k = 0..4, batch 1/4/16, 128 new tokens, 3 repeats,
    on CUDA; with transformers' greedy generate on the same weights when a checkpoint is given."""
    from ortspec.bench import run_bench, transformers_greedy

    result = run_bench(model, ks=(0, 1, 2, 3, 4), batches=(1, 4, 16), max_new_tokens=128, repeats=3,
                       provider="cuda", progress=False)
    if transformers_checkpoint:
        result["transformers"] = transformers_greedy(transformers_checkpoint, (1, 4, 16), 128, 3, device="cuda",
                                                     prompts_from=ortspec.Session(model))
    return result


def state_check_row_steps(graphs, prompts, new_tokens: int, k: int, commit: str, **options) -> int | None:
    """Row-steps of a scripted-draft state check (check_speculative), or None after printing
    how it failed."""
    try:
        return check_speculative(graphs, prompts, new_tokens, k, commit, **options).speculative_row_steps
    except ExactnessError as error:
        print("STATE CHECK FAILED:", error)
        return None


def graph_faults(session) -> int:
    """CUDA-graph fallbacks + invalidations of a Session (0 when every step replayed)."""
    return sum(c["fallbacks"] + c["invalidations"] for c in session.stats["graphs"].values())


def add_loop_arguments(parser, name: str, new_tokens_help: str = "tokens per request in the identity checks") -> None:
    """--out, --new-tokens and --rounds of the loop checks (greedy_loop, spec_loop, auto_loop)."""
    parser.add_argument("--out", default=f"/tmp/ortspec_gpu_{name}", help="working directory (converted models)")
    parser.add_argument("--new-tokens", type=int, default=64, help=new_tokens_help)
    parser.add_argument("--rounds", type=int, default=4, help="interleaved timing rounds (0: no timing)")


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])


def write_json(path, results: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(results, indent=1))
