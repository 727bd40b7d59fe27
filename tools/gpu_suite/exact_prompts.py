"""The held-out prompts of ``tools/gpu.py exact``: many, deterministic, used by no benchmark.

Each prompt is one of a dozen templates of everyday Python (a function with its docstring, a
method, a loop, a context manager, a test, ...) filled with names drawn by ``random.Random``
from a fixed seed: the same list on every machine and Python version, with no file read.
Not cut from the standard library or site-packages: the trained model learned those, and a
memorised continuation has wide logit margins, which hides the near-ties where fp16/bf16
rounding flips a token. ``held_out_texts`` refuses any prompt that contains, or is contained
in, a prompt of the benchmarks (ortspec bench, the GPU suite, the peer harness).
A model without a tokenizer gets seeded random token ids instead (``token_prompts``).
"""

from __future__ import annotations

import random

import numpy as np

SEED = 1215  # issue 12, part 3
TEMPLATES = (
    'def {verb}_{noun}({arg}, {arg2}):\n    """{Verb} the {noun} of {arg}."""\n    ',
    "class {Noun}{suffix}:\n    def __init__(self, {arg}, {arg2}=None):\n        self.{arg} = {arg}\n        ",
    "for {arg}, {arg2} in {noun}s.items():\n    if {arg2} is None:\n        ",
    'with open({arg}_path, "{mode}") as {handle}:\n    for line in {handle}:\n        ',
    "try:\n    {noun} = {module}.{verb}({arg})\nexcept {error} as exc:\n    ",
    "{noun}s = [{arg}.{attr} for {arg} in {arg2}s if {arg}.{attr}]\n",
    "import {module}\nimport {module2}\n\n{const} = {number}\n\n\ndef {verb}_{noun}(",
    "    @property\n    def {noun}_{attr}(self):\n        return self._{noun}",
    "def test_{verb}_{noun}():\n    {noun} = {Noun}{suffix}()\n    assert ",
    "while {noun}s:\n    {arg} = {noun}s.pop()\n    ",
    "    def {verb}(self, {arg}, *, {arg2}={number}):\n        if not {arg}:\n            raise {error}(",
    "{noun}_by_{attr} = {{}}\nfor {arg} in {arg2}s:\n    {noun}_by_{attr}.setdefault(",
)
WORDS = {
    "verb": ("load", "merge", "render", "split", "encode", "resolve", "collect", "flush", "rotate", "validate",
             "compress", "schedule", "normalize", "parse", "filter", "index"),
    "noun": ("record", "buffer", "token", "segment", "layout", "account", "message", "column", "session", "chunk",
             "vertex", "invoice", "packet", "sample", "ticket", "widget"),
    "arg": ("item", "entry", "node", "key", "value", "row", "frame", "block", "path", "name", "limit", "field"),
    "attr": ("size", "owner", "label", "offset", "weight", "status", "kind", "parent"),
    "module": ("os", "json", "time", "struct", "shutil", "hashlib", "zlib", "csv", "logging", "itertools"),
    "error": ("ValueError", "KeyError", "OSError", "TypeError", "RuntimeError", "LookupError"),
    "suffix": ("Store", "Reader", "Builder", "Cache", "Queue", "Index", "Table", "Pool"),
    "mode": ("r", "rb", "w", "a"),
    "handle": ("fh", "stream", "source", "f"),
}


def bench_prompt_texts() -> list[str]:
    """Every text prompt of the repository's benchmarks."""
    from ortspec.bench import PROMPT_TEXTS
    from tools.gpu_suite.common import CODE_PROMPTS
    from tools.peer.prompts import HELD_OUT_TEXTS

    return [*PROMPT_TEXTS, *CODE_PROMPTS, *HELD_OUT_TEXTS]


def _fill(template: str, rng: random.Random) -> str:
    pick = {name: rng.choice(words) for name, words in WORDS.items()}
    arg2 = rng.choice([w for w in WORDS["arg"] if w != pick["arg"]])
    module2 = rng.choice([w for w in WORDS["module"] if w != pick["module"]])
    return template.format(**pick, arg2=arg2, module2=module2, Verb=pick["verb"].capitalize(),
                           Noun=pick["noun"].capitalize(), const=f"MAX_{pick['noun'].upper()}S",
                           number=rng.choice((3, 8, 16, 64, 100, 1024)))


def held_out_texts(count: int, seed: int = SEED) -> list[str]:
    """``count`` distinct prompts (templates in turn, names drawn from the seed)."""
    rng, texts, seen = random.Random(seed), [], set()
    bench = bench_prompt_texts()
    while len(texts) < count:
        text = _fill(TEMPLATES[len(texts) % len(TEMPLATES)], rng)
        if text in seen:
            continue
        if any(b in text or text in b for b in bench):
            raise AssertionError(f"held-out prompt {text!r} overlaps a benchmark prompt")
        seen.add(text)
        texts.append(text)
    return texts


def token_prompts(session, count: int, seed: int = SEED) -> list[list[int]]:
    """The prompts as token ids: the held-out texts through the model's tokenizer, or for a
    model without one seeded random ids (lengths 6..29)."""
    if session.manifest.tokenizer_path is not None:
        return [session.tokenizer.encode(text).ids for text in held_out_texts(count, seed)]
    rng, vocab = np.random.default_rng(seed), session.manifest.spec.vocab_size
    return [rng.integers(1, vocab, int(rng.integers(6, 30))).tolist() for _ in range(count)]
