"""What ``convert`` may do to its output directory, decided before any work is done.

- OUT_DIR does not exist, or is an empty directory: the model is created there.
- OUT_DIR holds an ortspec model (an ortspec manifest.json, or one too damaged to parse, and
  nothing but files a conversion writes: manifest.json, weights.bin, *.onnx, tokenizer files):
  refused unless overwrite=True, which replaces the whole directory, so no graph of the old
  model survives. (A damaged model's load error says to reconvert with overwrite: that works.)
- Anything else is refused even with overwrite=True: a file, a directory holding other files
  (ortspec deletes only what it wrote), the checkpoint directory, or a directory containing
  the checkpoint (replacing it would delete the weights the model is made from).

The same check runs again just before the new model is moved into place (converter/staging.py),
so a directory that changed during a long conversion is not replaced on the old verdict.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

from ..errors import OutputDirError
from ..manifest import MANIFEST_FILE, TOKENIZER_FILES, WEIGHTS_FILE

MODEL_FILE_PATTERNS = (MANIFEST_FILE, WEIGHTS_FILE, "*.onnx", *TOKENIZER_FILES)


def check_output_dir(out_dir: Path, checkpoint_dir: Path, overwrite: bool) -> None:
    """Raises OutputDirError if converting checkpoint_dir into out_dir must not go ahead."""
    out, checkpoint = out_dir.resolve(), checkpoint_dir.resolve()
    if out == checkpoint or out in checkpoint.parents:
        what = "is the checkpoint directory" if out == checkpoint else f"contains the checkpoint {checkpoint}"
        raise OutputDirError(f"the output directory {out_dir} {what}; writing the model there would replace the "
                             "weights it is made from. Choose another output directory.")
    check_destination(out, overwrite)


def check_destination(out: Path, overwrite: bool) -> None:
    """The part of the policy that looks only at out (a resolved path)."""
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"the output path {out} is a file, not a directory. Choose a directory path "
                             "(it is created if missing).")
    if not out.is_dir():
        return
    try:
        entries = sorted(out.iterdir())
    except OSError as exc:
        raise OutputDirError(f"cannot list the output directory {out}: {exc.strerror}. Choose a directory "
                             "you can read and write.") from exc
    if not entries:
        return
    foreign = [p.name + ("/" if p.is_dir() else "") for p in entries if not _is_model_file(p)]
    if foreign or not _manifest_may_be_ours(out):
        listed = (", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")) if foreign else "no ortspec manifest"
        raise OutputDirError(
            f"the output directory {out} is not empty and is not an ortspec model ({listed}); ortspec replaces "
            "only directories it wrote, even with overwrite. Choose a new or empty directory, or remove this one "
            "yourself.")
    if not overwrite:
        raise OutputDirError(
            f"the output directory {out} already holds a converted model. Pass overwrite=True (--overwrite) to "
            "replace it whole, or choose another directory.")


def _is_model_file(path: Path) -> bool:
    return path.is_file() and any(fnmatch.fnmatchcase(path.name, p) for p in MODEL_FILE_PATTERNS)


def _manifest_may_be_ours(out: Path) -> bool:
    """An ortspec manifest.json, or one too damaged to say whose it is (cut short, overwritten)."""
    try:
        raw = (out / MANIFEST_FILE).read_bytes()
    except OSError:  # missing or unreadable
        return False
    try:
        doc = json.loads(raw)
    except ValueError:  # not UTF-8 or not JSON
        return True
    return isinstance(doc, dict) and str(doc.get("format", "")).startswith("ortspec/")
