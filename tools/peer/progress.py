"""Progress lines: flushed, each with the seconds since the harness started, so a host log read
after the fact (or cut short by a time limit) shows which phase ran when."""

from __future__ import annotations

import time

START = time.perf_counter()


def say(message: str) -> None:
    print(f"peer_bench [{time.perf_counter() - START:6.1f} s] {message}", flush=True)
