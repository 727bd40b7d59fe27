"""A converted model is written into a temporary directory beside its destination and moved
into place only when complete, so no reader ever sees half of a model:

    parent/.NAME.ortspec-tmp-HEX/   every file written here, its size and sha256 recorded as
        |                           it is written (no second read), then flushed to disk
        |-- complete  -> moved to parent/NAME in one rename; an existing model there is swapped
        |                out in the same step (renameat2 RENAME_EXCHANGE) and then deleted
        |-- an error  -> deleted; parent/NAME untouched
        '-- killed    -> left behind, hidden, parent/NAME untouched; the next conversion into
                         parent/NAME deletes it

Beside the destination means on the same filesystem, where a rename is atomic. While a
conversion runs it holds a shared flock on the parent directory; the lock dies with the process
(even on SIGKILL). A conversion that can take the lock exclusively knows that no other
conversion runs there, so every staging directory of NAME is a dead one and it deletes them.
Where renameat2 is missing (macOS, Windows, old glibc) the old model is renamed aside and the
new one renamed in: for that instant the directory is absent, never half-written.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
import warnings
from pathlib import Path

from ..errors import OutputDirError
from ..integrity import CHECKSUM, file_record
from . import rename
from .output_dir import check_destination

try:
    import fcntl
except ImportError:  # Windows: no flock; stale staging directories are then left for the user
    fcntl = None

_TAG = ".ortspec-tmp-"


class RecordingFile:
    """A file being written that counts and hashes its bytes on the way out."""

    def __init__(self, path: Path) -> None:
        self.path, self.size = path, 0
        self._digest = hashlib.new(CHECKSUM)
        self._file = _io(path, lambda: open(path, "wb"))

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        _io(self.path, lambda: self._file.write(view))
        self._digest.update(view)
        self.size += view.nbytes
        return view.nbytes

    def close(self) -> dict:
        """Flushes the file to disk (a power cut after publishing must not leave it empty); returns its record."""
        _io(self.path, lambda: (self._file.flush(), os.fsync(self._file.fileno()), self._file.close()))
        return file_record(self.size, self._digest.hexdigest())

    def abandon(self) -> None:
        self._file.close()


class StagingDir:
    """``with StagingDir(out, overwrite) as staging:`` write files with ``create`` / ``write_bytes`` /
    ``copy``, then ``publish()``. Leaving the block without publishing deletes everything written."""

    def __init__(self, out: Path, overwrite: bool) -> None:
        self.out, self.overwrite = out.resolve(), overwrite
        self.files: dict[str, dict] = {}  # name -> {"size", "sha256"} of every recorded file
        _io(self.out.parent, lambda: self.out.parent.mkdir(parents=True, exist_ok=True))
        self._lock = _claim_parent(self.out)
        self.path = self.out.parent / f".{self.out.name}{_TAG}{secrets.token_hex(6)}"
        try:
            _io(self.path, self.path.mkdir)
        except OutputDirError:
            _unlock(self._lock)
            raise
        self.published = False

    def __enter__(self) -> "StagingDir":
        return self

    def __exit__(self, *exc) -> None:
        if not self.published:
            shutil.rmtree(self.path, ignore_errors=True)
        _unlock(self._lock)

    @contextlib.contextmanager
    def create(self, name: str, record: bool = True):
        """Yields a RecordingFile for name; it is recorded (if record) once the block completes."""
        f = RecordingFile(self.path / name)
        try:
            yield f
        except BaseException:
            f.abandon()
            raise
        entry = f.close()
        if record:
            self.files[name] = entry

    def write_bytes(self, name: str, data, record: bool = True) -> None:
        with self.create(name, record) as f:
            f.write(data)

    def copy(self, source: Path, name: str) -> None:
        with open(source, "rb") as src, self.create(name) as f:
            shutil.copyfileobj(src, f)

    def publish(self) -> None:
        """Moves the complete model to out in one step, after checking out again."""
        check_destination(self.out, self.overwrite)
        _fsync_dir(self.path)
        _io(self.out, self._move_into_place)
        self.published = True
        _fsync_dir(self.out.parent)

    def _move_into_place(self) -> None:
        if not self.out.exists():
            if not rename.rename_noreplace(self.path, self.out):
                os.rename(self.path, self.out)
            return
        shutil.copymode(self.out, self.path)  # a replaced directory keeps its permissions
        if rename.exchange(self.path, self.out):  # out: the new model; self.path: the old directory
            _remove(self.path)
            return
        aside = self.out.parent / f".{self.out.name}{_TAG}{secrets.token_hex(6)}"
        os.rename(self.out, aside)  # until the next rename, out is absent: no model, never half of one
        try:
            os.rename(self.path, self.out)
        except OSError:
            os.rename(aside, self.out)
            raise
        _remove(aside)


def _claim_parent(out: Path):
    """Takes a shared flock on out's parent for the whole conversion (returns its descriptor, or
    None where flock is unavailable). First, if the lock can be had exclusively, no conversion runs
    in that parent: staging directories of out left there are dead ones, and are deleted."""
    if fcntl is None:
        return None
    try:
        fd = os.open(out.parent, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for stale in out.parent.glob(f".{out.name}{_TAG}*"):
            shutil.rmtree(stale, ignore_errors=True)
    except OSError:  # another conversion runs in this parent: its staging directory may be live
        pass
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError:  # a filesystem without flock (some network filesystems): convert unlocked
        os.close(fd)
        return None
    return fd


def _unlock(fd) -> None:
    if fd is not None:
        os.close(fd)


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        warnings.warn(f"ortspec convert: could not delete the replaced model at {path}; delete it yourself.",
                      stacklevel=3)


def _fsync_dir(path: Path) -> None:
    """Makes a directory's entries durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _io(path: Path, action):
    """Runs a filesystem action; an OSError becomes an OutputDirError saying what to do."""
    try:
        return action()
    except OSError as exc:
        raise OutputDirError(
            f"writing the converted model failed at {path}: {exc.strerror or exc}. Check that the output "
            "directory's parent is writable and has room for the model, then convert again.") from exc
