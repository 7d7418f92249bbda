"""A bounded cache of encoder outputs by media identity, so the same image is encoded once.

Keyed by ``LoadedImage.identity`` (``uuid:<uuid>`` or ``sha256:<digest of the pixels>``),
least recently used entries evicted beyond ``max_entries``. Thread-safe: requests are
prepared on the callers' threads. Values are opaque here (the engine stores the image's
embedding rows). ``hits`` and ``misses`` count lookups.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

Value = TypeVar("Value")


class EncoderCache(Generic[Value]):
    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, Value] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, identity: str) -> Value | None:
        with self._lock:
            value = self._entries.get(identity)
            if value is None:
                self.misses += 1
                return None
            self._entries.move_to_end(identity)
            self.hits += 1
            return value

    def put(self, identity: str, value: Value) -> None:
        if self.max_entries == 0:
            return
        with self._lock:
            self._entries[identity] = value
            self._entries.move_to_end(identity)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
