"""Rows of an embedding arena: who holds them, and which are kept for reuse.

An arena (``model/embedding_io.EmbeddingArena``) is ``total_rows`` rows of ``hidden_size``
elements; one media item's embeddings take ``num_tokens`` rows. ``RowPool`` hands out free
rows, lowest first (so an item's rows are mostly one contiguous run: one NIXL descriptor).

``EmbeddingEntries`` (the encoder's cache) maps a media identity to its rows and a count of
the handles holding them. An entry no handle holds stays *cached* — its rows keep their
values, and the next Encode of the same identity reuses them — until a new entry needs the
rows (least recently used first) or the cache holds more than ``max_cached_entries``.

Invariant (``check``): every row is exactly one of free, cached (an entry with no holder) or
held (an entry with holders): free + cached + held = total. Not thread-safe: the encoder
engine calls it under its lock.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass


class RowPool:
    """Free rows as sorted, disjoint runs ``[start, end)``: compact for millions of rows."""

    def __init__(self, total_rows: int) -> None:
        self.total_rows = total_rows
        self._runs: list[list[int]] = [[0, total_rows]] if total_rows else []
        self.num_free = total_rows

    def allocate(self, count: int) -> tuple[int, ...] | None:
        """``count`` free rows in ascending order, lowest first, or None (nothing taken) when fewer are free."""
        if count > self.num_free:
            return None
        rows: list[int] = []
        while len(rows) < count:
            run = self._runs[0]
            take = min(count - len(rows), run[1] - run[0])
            rows.extend(range(run[0], run[0] + take))
            run[0] += take
            if run[0] == run[1]:
                self._runs.pop(0)
        self.num_free -= count
        return tuple(rows)

    def free(self, rows: tuple[int, ...]) -> None:
        for row in rows:
            self._free_one(row)
        self.num_free += len(rows)

    def _free_one(self, row: int) -> None:
        at = bisect.bisect_left(self._runs, [row + 1])  # the first run starting after ``row``
        before = self._runs[at - 1] if at else None
        assert before is None or before[1] <= row, f"row {row} freed twice"
        after = self._runs[at] if at < len(self._runs) else None
        if before is not None and before[1] == row:
            before[1] = row + 1
            if after is not None and after[0] == row + 1:
                before[1] = after[1]
                self._runs.pop(at)
        elif after is not None and after[0] == row + 1:
            after[0] = row
        else:
            self._runs.insert(at, [row, row + 1])

    def is_free(self, row: int) -> bool:
        at = bisect.bisect_right(self._runs, [row, self.total_rows + 1])
        return bool(at) and self._runs[at - 1][0] <= row < self._runs[at - 1][1]


@dataclass(eq=False)
class Entry:
    identity: str
    rows: tuple[int, ...]
    holders: int = 0


class EmbeddingEntries:
    def __init__(self, pool: RowPool, max_cached_entries: int) -> None:
        self.pool = pool
        self.max_cached_entries = max_cached_entries
        self._entries: dict[str, Entry] = {}
        self._cached: OrderedDict[str, Entry] = OrderedDict()  # holders == 0, least recently used first
        self.hits = 0
        self.misses = 0

    def acquire(self, identity: str, count_lookup: bool = True) -> tuple[int, ...] | None:
        """The rows of a known identity, now held once more; None when not known (a miss).
        ``count_lookup``: counts in ``hits``/``misses``."""
        entry = self._entries.get(identity)
        if entry is None:
            self.misses += count_lookup
            return None
        self.hits += count_lookup
        self._cached.pop(identity, None)
        entry.holders += 1
        return entry.rows

    def add(self, identity: str, count: int) -> tuple[int, ...] | None:
        """Rows for a new identity, held once; evicts cached entries for room. None: no room
        even with every cached entry evicted (nothing changed then)."""
        assert identity not in self._entries, "acquire first"
        if count > self.pool.num_free + sum(len(e.rows) for e in self._cached.values()):
            return None
        while self.pool.num_free < count:
            self._evict_oldest()
        rows = self.pool.allocate(count)
        assert rows is not None
        self._entries[identity] = Entry(identity, rows, holders=1)
        return rows

    def drop(self, identity: str) -> None:
        """One holder fewer; the last one leaves the entry cached (or frees it)."""
        entry = self._entries[identity]
        assert entry.holders > 0, "dropped more often than held"
        entry.holders -= 1
        if entry.holders == 0:
            self._cached[identity] = entry
            while len(self._cached) > self.max_cached_entries:
                self._evict_oldest()

    def evict_cached(self) -> None:
        while self._cached:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        identity, entry = self._cached.popitem(last=False)
        del self._entries[identity]
        self.pool.free(entry.rows)

    @property
    def held_rows(self) -> int:
        return sum(len(e.rows) for e in self._entries.values() if e.holders)

    @property
    def cached_rows(self) -> int:
        return sum(len(e.rows) for e in self._cached.values())

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def check(self) -> None:
        """The module invariant; raises AssertionError naming what is off."""
        rows = [r for e in self._entries.values() for r in e.rows]
        assert len(rows) == len(set(rows)), "a row belongs to two entries"
        assert not any(self.pool.is_free(r) for r in rows), "a row is both free and in an entry"
        total = self.pool.num_free + self.held_rows + self.cached_rows
        assert total == self.pool.total_rows, f"free + cached + held = {total}, not {self.pool.total_rows}"
        assert all(e.holders == 0 for e in self._cached.values()), "a cached entry has holders"
