"""Exception types. Every message names what was wrong and what to do about it.

Each class also derives from the built-in exception a caller would naturally catch
(ValueError, FileNotFoundError, ...), so ``except ValueError`` keeps working.
"""


class OrtspecError(Exception):
    """Base class of every error ortspec raises on purpose."""


class CheckpointError(OrtspecError, ValueError):
    """The HuggingFace checkpoint directory is missing, incomplete or malformed."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint directory or one of its required files does not exist."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint is of a model type or layout that ortspec does not convert."""


class WeightError(CheckpointError):
    """A weight is missing from the safetensors files or has the wrong shape."""


class ModelDirError(OrtspecError, ValueError):
    """A converted model directory (manifest.json + graphs) is missing or inconsistent."""


class InputError(OrtspecError, ValueError):
    """A prompt or generation argument is invalid (empty, out of vocabulary, too long)."""


class ConfigurationError(OrtspecError, ValueError):
    """A Session option is invalid for this model (k > K, unknown commit strategy, ...)."""


class ProviderError(OrtspecError, RuntimeError):
    """The requested execution provider is not available in the installed onnxruntime."""


class MissingDependencyError(OrtspecError, ImportError):
    """An optional package that a requested feature needs is not installed (e.g. matplotlib for
    ``ortspec bench --plot``); the message names what to install."""


class ClosedError(OrtspecError, RuntimeError):
    """A Session or a batcher was used after close()."""


class EnginesHeldError(OrtspecError, RuntimeError):
    """A call would wait forever for state buffers that its own thread holds (e.g. an open batcher)."""


class ConvertOptionError(CheckpointError, ConfigurationError):
    """An argument of ``convert`` is invalid: wrong type, out of range, or too large for the model
    or for this machine's memory. A ConfigurationError by meaning; also a CheckpointError, which
    is what convert raised for bad options before this class existed."""


class OutputDirError(OrtspecError, OSError):
    """``convert`` cannot or will not write its output directory: it is a file, not writable, the
    checkpoint itself, or an existing directory that it must not replace."""


class InternalError(OrtspecError, RuntimeError):
    """ortspec's own cross-check failed: a bug, not a bad input (e.g. a converted graph's accept
    lengths differ from the host's rule). Nothing was committed; the message says what to report."""


class ConcurrentUseError(OrtspecError, RuntimeError):
    """One batcher was called from two threads at once (its steps and requests share one engine's
    state buffers, in one order): give each thread its own batcher, or serialize the calls."""

