"""The prompt sets of the peer harness: the bench's code prompts and a held-out set.

The held-out prompts are used by no other benchmark in the repository (and were written after
the trained model and the bench's prompts were fixed), so a number measured on them was not
tuned on them. Both sets are encoded with the checkpoint's tokenizer.json when it has one;
a random model without a tokenizer gets fixed synthetic ids (the bench's formula for the code
set, a seeded draw for the held-out set) so both runtimes see identical token ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ortspec.bench import PROMPT_TEXTS

HELD_OUT_TEXTS = [
    "def merge_intervals(intervals):\n    ",
    "import json\n\n\ndef load_settings(path):",
    "class LRUCache:\n    def __init__(self, capacity):\n        ",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "    except KeyError as exc:\n        ",
    "async def fetch_all(session, urls):",
    "def test_roundtrip(tmp_path):\n    path = tmp_path /",
    "if __name__ == \"__main__\":\n    ",
]
SETS = ("code", "held_out")


@dataclass(frozen=True)
class Prompt:
    set: str  # "code" | "held_out"
    index: int
    ids: list[int]


def synthetic_ids(set_name: str, count: int, vocab: int) -> list[list[int]]:
    """Token ids for a model without a tokenizer: the code set as `ortspec bench` makes them,
    the held-out set drawn from a fixed seed (lengths 6..21)."""
    if set_name == "code":
        return [[(7 * i + 3 * j) % vocab for j in range(8 + i)] for i in range(count)]
    rng = np.random.default_rng(20261130)
    return [rng.integers(1, vocab, int(rng.integers(6, 22))).tolist() for _ in range(count)]


def load_prompts(checkpoint: Path, vocab: int, per_set: int | None = None) -> list[Prompt]:
    """Both sets, `per_set` prompts of each (default: all 8), code set first."""
    texts = {"code": PROMPT_TEXTS, "held_out": HELD_OUT_TEXTS}
    tokenizer_path = Path(checkpoint) / "tokenizer.json"
    tokenizer = None
    if tokenizer_path.exists():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    prompts = []
    for name in SETS:
        count = min(per_set or len(texts[name]), len(texts[name]))
        ids = ([tokenizer.encode(t).ids for t in texts[name][:count]] if tokenizer
               else synthetic_ids(name, count, vocab))
        prompts += [Prompt(name, i, [int(t) for t in p]) for i, p in enumerate(ids)]
    return prompts
