"""Opening an adapter's files so that what is read is what was confined to a root.

``LoraRegistry.confine`` resolves ``source_path`` and checks that it lies inside a configured
root. Opening a file by that path afterwards would race the check: in between, anyone who can
write inside the root could swap a directory or a file for a symlink leading out of it, and the
engine would read, say, ``/etc/shadow`` as adapter weights. So a file is opened from the root's
own descriptor one path component at a time, each with ``O_NOFOLLOW``: a component that is a
symlink when it is opened fails to open (ELOOP; ENOTDIR for a directory on Linux) instead of
being followed. A symlink that stays inside a root is still allowed, as it was: the file's path
is resolved first and the walk runs over the resolved path (if it changes meanwhile, the walk
fails). The last component must be a regular file; it is opened with ``O_NONBLOCK``, so a FIFO
swapped in fails the check instead of blocking the load forever.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class NotConfinedError(OSError):
    """The file is not a regular file inside a root (as opened, not as checked)."""


def root_of(roots: Sequence[str], resolved: str) -> str | None:
    """The root (each a real path) that holds the real path ``resolved``, if any."""
    return next((root for root in roots if os.path.commonpath([root, resolved]) == root), None)


def open_confined(roots: Sequence[str], path: str | Path) -> BinaryIO:
    """``path`` opened for reading, binary, if it is a regular file inside one of ``roots`` when
    opened; raises ``NotConfinedError`` or the open's own ``OSError`` otherwise."""
    resolved = os.path.realpath(path)
    root = root_of(roots, resolved)
    if root is None or resolved == root:
        raise NotConfinedError(f"{os.fspath(path)!r} is not a file inside an allowed LoRA root")
    *directories, name = Path(resolved).relative_to(root).parts
    fd = os.open(root, DIRECTORY_FLAGS)
    try:
        for part in directories:
            outer, fd = fd, os.open(part, DIRECTORY_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            os.close(outer)
        file_fd = os.open(name, FILE_FLAGS, dir_fd=fd)
    finally:
        os.close(fd)
    try:
        if not stat.S_ISREG(os.fstat(file_fd).st_mode):
            raise NotConfinedError(f"{resolved!r} is not a regular file")
        os.set_blocking(file_fd, True)  # O_NONBLOCK was for the open only
        return os.fdopen(file_fd, "rb")
    except BaseException:
        os.close(file_fd)
        raise
