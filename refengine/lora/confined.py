"""Opening an adapter's files so that what is read is what was confined to a root.

``LoraRegistry.confine`` resolves ``source_path`` and checks that it lies inside a configured
root. Opening a file by that path afterwards would race the check: in between, anyone who can
write inside the root could swap a directory or a file for a symlink leading out of it, and the
engine would read, say, ``/etc/shadow`` as adapter weights. So the adapter's directory is opened
once, from the root's own descriptor one path component at a time, each with ``O_NOFOLLOW``: a
component that is a symlink when it is opened fails to open (ELOOP; ENOTDIR for a directory on
Linux) instead of being followed. Its files are opened relative to that descriptor, again with
``O_NOFOLLOW``, so the config and the weights both come from the directory that was opened,
even if its path is renamed or swapped meanwhile (they could otherwise come from two adapters).

A symlink that stays inside a root is still allowed, as it was: the directory's path is resolved
first and the walk runs over the resolved path (if it changes meanwhile, the walk fails), and a
file that is a symlink is opened the same way by its resolved path (``open_confined``), only
while the directory's path still names the directory that was opened (checked before and after:
a rename back and forth between the checks could still mix files, though never from outside a
root). A file must be a regular file; it is opened with ``O_NONBLOCK`` (cleared once checked),
so a FIFO swapped in fails the check instead of blocking the load forever.
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
    return _regular(_walk(roots, path, directory=False), path)


class ConfinedDirectory:
    """A directory inside one of ``roots``, opened once (``_walk``); ``open`` opens its files
    relative to it. Close it (or use it as a context manager)."""

    def __init__(self, roots: Sequence[str], path: str | Path) -> None:
        self.roots, self.path = tuple(roots), os.fspath(path)
        self._fd = _walk(roots, path, directory=True)

    def open(self, name: str) -> BinaryIO:
        """The regular file ``name`` (one path component) of this directory. One that is a
        symlink is opened by its resolved path (``open_confined``: a file inside a root), and
        only while ``path`` still names this directory, checked before and after."""
        if name in ("", ".", "..") or os.sep in name:
            raise ValueError(f"{name!r} is not one file name")
        try:
            fd = os.open(name, FILE_FLAGS, dir_fd=self._fd)
        except OSError:
            if not stat.S_ISLNK(os.stat(name, dir_fd=self._fd, follow_symlinks=False).st_mode):
                raise  # not a symlink's refusal (ELOOP here, EMLINK or EFTYPE on some BSDs)
            self._still_at_path()
            stream = open_confined(self.roots, os.path.join(self.path, name))
            try:
                self._still_at_path()
            except BaseException:
                stream.close()
                raise
            return stream
        return _regular(fd, os.path.join(self.path, name))

    def _still_at_path(self) -> None:
        here, there = os.fstat(self._fd), os.stat(self.path)
        if (here.st_dev, here.st_ino) != (there.st_dev, there.st_ino):
            raise NotConfinedError(f"{self.path!r} is no longer the directory that was opened")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ConfinedDirectory:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _walk(roots: Sequence[str], path: str | Path, directory: bool) -> int:
    """A descriptor of ``path`` resolved, opened from its root component by component without
    following a symlink: a directory's (``directory``) or a file's."""
    resolved = os.path.realpath(path)
    root = root_of(roots, resolved)
    if root is None:
        raise NotConfinedError(f"{os.fspath(path)!r} is not inside an allowed LoRA root")
    if resolved == root and not directory:
        raise NotConfinedError(f"{os.fspath(path)!r} is a LoRA root itself, not a file")
    *directories, last = Path(resolved).relative_to(root).parts or (".",)
    fd = os.open(root, DIRECTORY_FLAGS)
    try:
        for part in directories:
            outer, fd = fd, os.open(part, DIRECTORY_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            os.close(outer)
        return os.open(last, (DIRECTORY_FLAGS | os.O_NOFOLLOW) if directory else FILE_FLAGS, dir_fd=fd)
    finally:
        os.close(fd)


def _regular(fd: int, shown: str | Path) -> BinaryIO:
    """``fd`` as a blocking binary file if it is a regular file; closed and refused otherwise."""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotConfinedError(f"{os.fspath(shown)!r} is not a regular file")
        os.set_blocking(fd, True)  # O_NONBLOCK was for the open only
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
