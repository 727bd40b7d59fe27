"""A fast conversion for the tests of the model directory and of convert's inputs."""

from __future__ import annotations

import ortspec


def convert_small(checkpoint, out, **options):
    """K=1 and max_length=32 unless options say otherwise: a conversion of the tiny checkpoint in ~0.3 s."""
    options.setdefault("num_speculative_tokens", 1)
    options.setdefault("max_length", 32)
    return ortspec.convert(checkpoint, out, progress=False, **options)
