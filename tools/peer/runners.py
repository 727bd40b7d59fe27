"""One runner per configuration of the side-by-side: each generates the new tokens of one prompt
(batch 1, greedy) and counts its steps, so timing and comparison code treats all alike.

    ortspec greedy / ortspec k=K        ortspec.Session(num_speculative_tokens=K), fp16 or fp32 conversion
    peer eager / peer graph             og.Generator on the builder's model (graph: enable_cuda_graph)
    peer mtp N=K [graph]                og.MtpGenerator(main, head) with max_draft_tokens=K

Every peer generator is created with the same max_length (the harness's context, equal to
ortspec's conversion max_length), so a graph captured once fits every prompt and both
runtimes size their KV caches alike. The peer is told to stop only by count: a run ends after
max_new_tokens calls of generate_next_token (each exposes exactly one token) or at eos.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import ortspec

from .export import PeerDirs


@dataclass
class StepCount:
    """Target steps and the tokens they emitted (tokens/step = tokens / steps)."""

    steps: int = 0
    tokens: int = 0

    def per_step(self) -> float | None:
        return self.tokens / self.steps if self.steps else None


class OrtspecRunner:
    side = "ortspec"

    def __init__(self, model_dir: Path, provider: str, k: int, threads: int | None = None):
        self.name = "ortspec greedy" if k == 0 else f"ortspec k={k}"
        self.k = k
        self.session = ortspec.Session(model_dir, provider=provider, num_speculative_tokens=k, threads=threads)
        self.count = StepCount()

    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        self.session.reset_stats()
        tokens = self.session.generate(prompt, max_new_tokens=max_new_tokens)
        st = self.session.stats
        steps = st["speculative_steps"] if self.k else st["steps"]
        self.count.steps += steps
        self.count.tokens += st["accepted"] + steps if self.k else steps
        return tokens


# Which directory each loaded model comes from. The MTP graph runs get a main model of their
# own: a captured graph binds one generator kind's buffers, so the greedy graph run and the
# MTP loop do not share one.
MODEL_DIRS = {"main": "main", "head": "head", "graph_main": "graph_main", "graph_mtp_main": "graph_main",
              "graph_head": "graph_head"}


@dataclass
class PeerModels:
    """og.Model objects, loaded once per key of MODEL_DIRS and shared by the configurations using it."""

    dirs: PeerDirs
    loaded: dict = field(default_factory=dict)

    def get(self, key: str):
        import onnxruntime_genai as og

        if key not in self.loaded:
            path = getattr(self.dirs, MODEL_DIRS[key])
            if path is None:
                raise FileNotFoundError(f"no peer model directory for {key} (no MTP head, or graphs on the CPU)")
            self.loaded[key] = og.Model(str(path))
        return self.loaded[key]


class PeerGreedyRunner:
    side = "peer"

    def __init__(self, models: PeerModels, graph: bool, max_length: int):
        self.name = "peer graph" if graph else "peer eager"
        self.model = models.get("graph_main" if graph else "main")
        self.max_length = max_length
        self.count = StepCount()

    def _generator(self):
        import onnxruntime_genai as og

        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=self.max_length, do_sample=False)
        return og.Generator(self.model, params)

    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        generator = self._generator()
        tokens = drive(generator, prompt, max_new_tokens, lambda: generator.get_sequence(0))
        self.count.steps += len(tokens)
        self.count.tokens += len(tokens)
        return tokens


class PeerMtpRunner:
    side = "peer"

    def __init__(self, models: PeerModels, graph: bool, k: int, max_length: int):
        self.name = f"peer mtp N={k}" + (" graph" if graph else "")
        self.main = models.get("graph_mtp_main" if graph else "main")
        self.head = models.get("graph_head" if graph else "head")
        self.k, self.max_length = k, max_length
        self.count = StepCount()

    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        import onnxruntime_genai as og

        params = og.GeneratorParams(self.main)
        params.set_search_options(max_length=self.max_length, do_sample=False)
        params.set_speculative_options(max_draft_tokens=self.k)
        generator = og.MtpGenerator(self.main, self.head, params)
        tokens = drive(generator, prompt, max_new_tokens, generator.get_sequence)
        stats = generator.get_stats()
        self.count.steps += int(stats["rounds"])
        self.count.tokens += int(stats["tokens_emitted"])
        return tokens


def drive(generator, prompt: list[int], max_new_tokens: int, sequence) -> list[int]:
    """Prefill `prompt`, then one generate_next_token per new token until max_new_tokens or eos."""
    generator.append_tokens(np.asarray(prompt, dtype=np.int32))
    for _ in range(max_new_tokens):
        if generator.is_done():
            break
        generator.generate_next_token()
    return [int(t) for t in sequence()[len(prompt):len(prompt) + max_new_tokens]]
