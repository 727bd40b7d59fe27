"""The process's peak resident memory before and after one prefill (session 15).

    python3 benchmarks/session15/prefill_rss.py MODEL_DIR PROMPT_TOKENS
"""
import resource
import sys

import numpy as np

import ortspec
from ortspec.runtime.model import TargetModel
from ortspec.runtime.states import Rows

session, n = ortspec.Session(sys.argv[1], threads=2), int(sys.argv[2])
target = TargetModel(session.graphs, 1)
target.reset(Rows([0]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ids = np.random.default_rng(0).integers(0, session.manifest.spec.vocab_size, (1, n))
target.prefill(Rows([0]), ids, np.arange(n)[None])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(f"{sys.argv[1]}: peak RSS before / after a prefill of {n} tokens: {before / 1024:.0f} / {after / 1024:.0f} MiB")
