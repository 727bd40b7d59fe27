"""ortspec: exact MTP speculative decoding on ONNX Runtime for hybrid Gated-DeltaNet + GQA models."""

from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigurationError,
    ConvertOptionError,
    InputError,
    ModelDirError,
    OrtspecError,
    ProviderError,
    UnsupportedModelError,
    WeightError,
)

__version__ = "0.1.0"


def convert(checkpoint_dir, out_dir, **options):
    """Converts a HuggingFace Qwen3.5-text checkpoint to ONNX graphs; see ortspec.converter.convert."""
    from .converter import convert as _convert

    return _convert(checkpoint_dir, out_dir, **options)


def __getattr__(name):
    if name == "Session":  # imported lazily so `ortspec convert` does not load onnxruntime sessions
        from .session import Session

        return Session
    raise AttributeError(name)


__all__ = ["Session", "convert", "OrtspecError", "CheckpointError", "CheckpointNotFoundError", "ConfigurationError",
           "ConvertOptionError", "InputError", "ModelDirError", "ProviderError", "UnsupportedModelError", "WeightError"]
