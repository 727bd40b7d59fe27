"""Sampled acceptance against the drafts' temperature: q drawn from the head's logits / (T tau).

    python3 tools/draft_temperature.py models/qwen35-python-20m --taus 0.8,1.0,1.2 -k 2 --seeds 12

Any q keeps speculative sampling exact (the acceptance reads the q a draft came from), so the
drafts' temperature is free to choose: this converts the checkpoint once per tau with the head's
draft passes at T x tau (the head in float32, --mtp-quant none), then runs seeded sampled
generate calls (temperature 0.8; top-p 1.0 and 0.95) over the code prompts of tools/serve_load.py
on the CPU, and prints each tau's acceptance rate. tau = 1 is what the converter builds.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ortspec  # noqa: E402
from ortspec.converter import fused_graph, graphs, sampling_graph  # noqa: E402
from ortspec.converter.sampling_graph import RowParams  # noqa: E402
from tools.serve_load import PROMPTS  # noqa: E402

DRAFT_SAMPLER = sampling_graph.draft_sampler


def sampler_at(tau: float):
    """draft_sampler with the drafts' temperature multiplied by tau."""
    def sampler(g, params, uniforms, first, vocab):
        t = g.op("Mul", [params.temperature, g.const(np.float32(tau), "float32")])
        return DRAFT_SAMPLER(g, RowParams(t, params.top_k, params.top_p, params.min_p), uniforms, first, vocab)
    return sampler


def convert_at(checkpoint: Path, out: Path, tau: float) -> Path:
    for module in (fused_graph, graphs):
        module.draft_sampler = sampler_at(tau)
    try:
        return ortspec.convert(checkpoint, out, num_speculative_tokens=4, max_length=512, overwrite=True,
                               progress=False, mtp_quant="none")
    finally:
        for module in (fused_graph, graphs):
            module.draft_sampler = DRAFT_SAMPLER


def acceptance(model: Path, k: int, top_p: float, seeds: int, threads: int) -> float:
    # a model without a tokenizer (the tests' random one): short token-id prompts instead
    prompts = PROMPTS[:8] if (model / "tokenizer.json").exists() else [[1 + i, 5 + i, 9 + i] for i in range(8)]
    with ortspec.Session(model, num_speculative_tokens=k, threads=threads) as session:
        for seed in range(seeds):
            session.generate(prompts, max_new_tokens=96, stop_tokens=[], temperature=0.8, top_p=top_p, seed=seed)
        return session.stats["acceptance_rate"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--taus", default="0.8,1.0,1.2")
    parser.add_argument("-k", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=12, help="generate calls of 8 prompts x 96 tokens per cell")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    print("| tau | acceptance, top-p 1.0 | acceptance, top-p 0.95 |\n|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for tau in (float(t) for t in args.taus.split(",")):
            model = convert_at(args.checkpoint, Path(root) / f"tau{tau}", tau)
            cells = [acceptance(model, args.k, top_p, args.seeds, args.threads) for top_p in (1.0, 0.95)]
            print(f"| {tau} | {cells[0]:.3f} | {cells[1]:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
