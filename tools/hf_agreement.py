"""How often ortspec's greedy continuation equals transformers' own greedy generate, token for token.

    python3 tools/hf_agreement.py CHECKPOINT MODEL_DIR [MODEL_DIR ...] [--dtype float16] [--prompts 48]
                                  [--new-tokens 64] [--provider cpu]

transformers (``Qwen3_5ForCausalLM`` in ``--dtype``, on the CPU) generates greedily from each
prompt alone (batch 1, no padding); each converted model directory generates from the same
prompts with ortspec (greedy, stop tokens off). A half-precision model's tokens depend on where
it rounds: this counts, per model directory, the prompts whose continuations are identical and
how many tokens the two share before their first difference. It is how the float16 conversions
with ``--activations float32`` and ``--activations model`` were compared against transformers'
float16 run (transformers keeps a float16 residual stream, float16 norms in and out).

The prompts are the held-out ones of ``tools/gpu.py exact`` (everyday Python; random ids for a
model without a tokenizer): not memorised, so near-ties occur. Tables last.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import ortspec  # noqa: E402
from ortspec.manifest import Manifest  # noqa: E402
from tools.gpu_suite.exact_prompts import token_prompts  # noqa: E402


@dataclasses.dataclass
class Agreement:
    """One model directory against transformers over the same prompts."""

    model: str
    prompts: int
    identical: int  # prompts whose whole continuation equals transformers'
    shared_tokens: float  # mean tokens before the first difference (new_tokens where identical)


def transformers_greedy(checkpoint, prompts: list[list[int]], new_tokens: int, dtype: str) -> list[list[int]]:
    """transformers' greedy continuation of each prompt alone, exactly new_tokens tokens."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def shared_prefix(a: list[int], b: list[int]) -> int:
    """Tokens a and b share before their first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(model_dir, prompts: list[list[int]], reference: list[list[int]], new_tokens: int,
              provider: str = "cpu") -> Agreement:
    session = ortspec.Session(model_dir, provider=provider)
    outputs = session.generate(prompts, max_new_tokens=new_tokens, stop_tokens=[])
    shared = [shared_prefix(out, ref) for out, ref in zip(outputs, reference)]
    return Agreement(str(model_dir), len(prompts), sum(s == new_tokens for s in shared), sum(shared) / len(shared))


def compare(checkpoint, model_dirs: list, count: int, new_tokens: int, dtype: str,
            provider: str = "cpu") -> list[Agreement]:
    """Every model directory against transformers' greedy in dtype, over `count` held-out prompts."""
    prompts = token_prompts(ortspec.Session(model_dirs[0]), count)
    reference = transformers_greedy(checkpoint, prompts, new_tokens, dtype)
    return [agreement(d, prompts, reference, new_tokens, provider) for d in model_dirs]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="the HuggingFace checkpoint the models were converted from")
    parser.add_argument("model_dirs", nargs="+", type=Path, help="converted model directories")
    parser.add_argument("--dtype", default="float16", help="transformers' dtype (default float16)")
    parser.add_argument("--prompts", type=int, default=48, help="held-out prompts (default 48)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    parser.add_argument("--provider", default="cpu", help="ortspec's provider (default cpu)")
    args = parser.parse_args(argv)
    results = compare(args.checkpoint, args.model_dirs, args.prompts, args.new_tokens, args.dtype, args.provider)
    print(f"transformers {args.dtype} greedy vs ortspec greedy, {args.prompts} held-out prompts x "
          f"{args.new_tokens} tokens\n")
    print("| model | activations | identical prompts | mean tokens before the first difference |\n|---|---|---|---|")
    for r in results:
        activations = Manifest.load(r.model).activations
        print(f"| {r.model} | {activations} | {r.identical}/{r.prompts} | {r.shared_tokens:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
