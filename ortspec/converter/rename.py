"""Atomic directory renames, for publishing a converted model in one step.

Linux has ``renameat2`` (glibc >= 2.28, reached here through ctypes since Python does not wrap
it): RENAME_EXCHANGE swaps two existing directories atomically, RENAME_NOREPLACE moves a
directory to a name that must not exist. Each function returns False where the platform,
libc or filesystem cannot do it (macOS, Windows, some network filesystems), and the caller
falls back to plain renames; it raises OSError for a real failure (permissions, a name that
appeared meanwhile).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import sys
from pathlib import Path

_AT_FDCWD = -100
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}


def exchange(a: Path, b: Path) -> bool:
    """Swaps the directories at a and b in one step: a reader of either name sees the old
    directory or the new one, never neither and never a mix."""
    return _renameat2(a, b, _RENAME_EXCHANGE)


def rename_noreplace(src: Path, dst: Path) -> bool:
    """Moves src to dst in one step; raises FileExistsError if dst exists (even an empty
    directory, which a plain rename would silently replace)."""
    return _renameat2(src, dst, _RENAME_NOREPLACE)


@functools.lru_cache(maxsize=None)
def _libc_renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # no libc handle, or a libc older than glibc 2.28
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    function = _libc_renameat2()
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), str(src), None, str(dst))
