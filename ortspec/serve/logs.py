"""The server's own log lines, in the HTTP process and the engine process alike."""

from __future__ import annotations

import logging
import sys


def log_to_stderr(level: str) -> None:
    """ortspec.serve's lines (disconnects, 500 tracebacks) beside uvicorn's, at its level."""
    log = logging.getLogger("ortspec.serve")
    log.setLevel(level.upper())
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        log.addHandler(handler)
