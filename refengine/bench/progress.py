"""A one-line progress bar on stderr (``[#####.....] 37/100``), safe to advance from the
request threads. No dependency: a bench for any server should install nothing extra."""

from __future__ import annotations

import sys
import threading
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    def __init__(self, total: int, stream: TextIO | None = None, width: int = 30) -> None:
        self.total, self.width, self.done = total, width, 0
        self.closed = False  # after an interrupted run, the cancelled requests still end: draw them no more
        self.stream = stream or sys.stderr
        self.lock = threading.Lock()
        self._draw()

    def _draw(self) -> None:
        filled = self.width * self.done // max(1, self.total)
        self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total}")
        self.stream.flush()

    def advance(self) -> None:
        with self.lock:
            self.done += 1
            if not self.closed:
                self._draw()

    def close(self) -> None:
        """End the line, so that what follows starts on a fresh one."""
        with self.lock:
            self.closed = True
            self.stream.write("\n")
            self.stream.flush()
