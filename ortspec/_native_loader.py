"""Imports the extension module ortspec._native, with an error that says how to build it.

The runtime layer imports the native module through here so that a checkout without a
built extension fails with instructions instead of a bare ModuleNotFoundError.
"""

from types import ModuleType

_BUILD_HINT = (
    "ortspec._native (the C++/CUDA extension) is not built or failed to load. Build it from "
    "the repository root with `pip install -e .` (or `pip install --no-build-isolation "
    "--no-deps -e .` on a host without a package registry); it needs a C++17 compiler and "
    "pybind11>=2.12, and compiles CUDA kernels when nvcc is found (ORTSPEC_NO_CUDA=1 to skip)."
)


def load_native() -> ModuleType:
    """Returns ortspec._native; raises ImportError with build instructions when missing."""
    try:
        from ortspec import _native
    except ImportError as error:
        raise ImportError(f"{_BUILD_HINT} Cause: {error}") from error
    return _native
