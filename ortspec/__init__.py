"""ortspec: exact MTP speculative decoding on ONNX Runtime for hybrid Gated-DeltaNet + GQA models."""

from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ClosedError,
    ConcurrentUseError,
    ConfigurationError,
    ConvertOptionError,
    EnginesHeldError,
    InputError,
    InternalError,
    MissingDependencyError,
    ModelDirError,
    OrtspecError,
    OutputDirError,
    ProviderError,
    UnsupportedModelError,
    WeightError,
)

__version__ = "0.1.0"


def convert(checkpoint_dir, out_dir, **options):
    """Converts a HuggingFace Qwen3.5-text checkpoint to ONNX graphs; see ortspec.converter.convert."""
    from .converter import convert as _convert

    return _convert(checkpoint_dir, out_dir, **options)


def verify(model_dir) -> dict[str, int]:
    """Checks every file of a converted model against the size and sha256 recorded at conversion
    (reads every byte). Raises ModelDirError naming the first file that differs; returns
    {file name: size} of the files checked. (Loading a Session checks the sizes only.)"""
    from .manifest import Manifest

    return Manifest.load(model_dir).verify()


def __getattr__(name):
    if name == "Session":  # imported lazily so `ortspec convert` does not load onnxruntime sessions
        from .session import Session

        return Session
    raise AttributeError(name)


__all__ = ["Session", "convert", "verify", "OrtspecError", "CheckpointError", "CheckpointNotFoundError",
           "ClosedError", "ConcurrentUseError", "ConfigurationError", "ConvertOptionError", "EnginesHeldError", "InputError",
           "InternalError", "MissingDependencyError", "ModelDirError", "OutputDirError", "ProviderError", "UnsupportedModelError",
           "WeightError"]
