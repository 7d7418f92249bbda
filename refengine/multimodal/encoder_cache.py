"""A bounded cache of encoder outputs by media identity, so the same image is encoded once.

Keyed by ``LoadedImage.identity`` (``uuid:<uuid>`` or ``sha256:<digest of the pixels>``),
least recently used entries evicted beyond ``max_entries`` or ``max_bytes`` (their sizes
by ``size_of``): entries alone did not bound memory, as one entry of a large vision model
is megabytes (576 rows x 4,096 float32 = 9 MiB), so 256 of them could hold 2.4 GiB that no
budget counted. The rows live on the model's device (GPU memory on CUDA), beside the KV pool,
whose ``--kv-memory-mib`` does not include them. An entry larger than ``max_bytes`` is not
kept; ``max_bytes`` 0 keeps nothing. Thread-safe: requests are
prepared on the callers' threads. Values are opaque here (the engine stores the image's
embedding rows). ``hits`` and ``misses`` count lookups.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

Value = TypeVar("Value")


class EncoderCache(Generic[Value]):
    """Invariant: ``num_bytes`` is the sum of the entries' sizes, at most ``max_bytes``, and
    there are at most ``max_entries`` entries."""

    def __init__(self, max_entries: int, max_bytes: int, size_of: Callable[[Value], int]) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._size_of = size_of
        self._entries: OrderedDict[str, tuple[Value, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.num_bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, identity: str) -> Value | None:
        with self._lock:
            entry = self._entries.get(identity)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(identity)
            self.hits += 1
            return entry[0]

    def put(self, identity: str, value: Value) -> None:
        size = self._size_of(value)
        with self._lock:
            self._drop(identity)
            if self.max_entries == 0 or self.max_bytes == 0 or size > self.max_bytes:
                return
            self._entries[identity] = (value, size)
            self.num_bytes += size
            while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))

    def _drop(self, identity: str) -> None:
        entry = self._entries.pop(identity, None)
        if entry is not None:
            self.num_bytes -= entry[1]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.num_bytes = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
