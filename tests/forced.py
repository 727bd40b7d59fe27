"""Teacher-forced logits: the target's logits before each of a sequence's tokens, the reference
that log-probability tests compare against. A prefill scores only its prompt's last row, so the
rows after it come from one decode each, the graph that chose them."""

from __future__ import annotations

import numpy as np

from ortspec.runtime.model import TargetModel
from ortspec.runtime.states import Rows


def forced_logits(graphs, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """[len(tokens), V] float32: row i the logits the target gives after prompt + tokens[:i]."""
    target, rows, n = TargetModel(graphs, 1), Rows([0]), len(prompt)
    target.reset(rows)
    out = target.prefill(rows, np.array([prompt], np.int64), np.arange(n, dtype=np.int64)[None])
    logits = [out.logits()[0, -1]]
    for i, token in enumerate(tokens[:-1]):
        out = target.decode(rows, np.array([[token]], np.int64), np.array([[n + i]], np.int64))
        logits.append(out.logits()[0, 0])
    return np.stack(logits)
