"""The KV event hub: numbers each step's events into a ``KvEventBatch``, keeps a bounded
window for replay, and fans batches out to subscribers, each with a bounded buffer.

The step thread calls ``publish`` once per step with events; it never blocks and never
waits on a subscriber. A subscriber whose buffer is full is cut off (its stream ends with
one error after the batches it already holds): it can never slow the step loop or grow
memory, and it never silently misses a batch. Subscribing happens between steps (the
front end holds its step lock), so a snapshot and the live batches that follow it are
gap-free and duplicate-free.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from refengine.types import BlockStored, KvEvent, KvEventBatch

#: What SubscribeKvEvents and GetKvEventSources say on a server started without KV events.
KV_EVENTS_DISABLED = "KV events are disabled on this server (it was started with --no-kv-events)"

logger = logging.getLogger(__name__)


class KvEventSubscription:
    """One subscriber's view of the hub: batches in order, then possibly one failure.

    ``on_ready`` is called (from any thread, never blocking) whenever something new can be
    taken; ``take`` returns everything available now."""

    def __init__(self, capacity: int, on_ready: Callable[[], None]) -> None:
        self._capacity = capacity
        self._on_ready = on_ready
        self._lock = threading.Lock()
        self._batches: deque[KvEventBatch] = deque()
        self._num_live = 0  # queued live batches: only these count against the capacity
        self.failure: str | None = None  # set once; no batch is queued after it
        self.closed = False

    def _push(self, batch: KvEventBatch, bounded: bool = True) -> bool:
        """Queue ``batch``; False (and the subscription ends) when the buffer is full. The
        snapshot and a replay are not bounded by the buffer, nor counted against it: they hold
        batches the hub retains anyway (a replay is bounded by the retained window), and a replay
        longer than the buffer must not cut off the subscriber before it could read anything."""
        with self._lock:
            if self.failure is not None or self.closed:
                return False
            if bounded and self._num_live >= self._capacity:
                self.failure = (f"KV event subscriber too slow: {self._capacity} batches unread; "
                                f"resubscribe from sequence number {batch.sequence_number}")
            else:
                self._batches.append(batch)
                if bounded:
                    self._num_live += 1
        self._on_ready()
        return self.failure is None

    def _fail(self, message: str) -> None:
        with self._lock:
            self.failure = self.failure or message
        self._on_ready()

    def take(self) -> tuple[list[KvEventBatch], str | None]:
        """The batches queued so far, and the failure once no batch is left before it."""
        with self._lock:
            batches = list(self._batches)
            self._batches.clear()
            self._num_live = 0
            return batches, self.failure

    def close(self) -> None:
        """The subscriber went away: the hub drops it at its next publish."""
        self.closed = True


class KvEventHub:
    def __init__(self, retained_batches: int, subscriber_buffer: int, data_parallel_rank: int = 0) -> None:
        self.retained_batches = retained_batches
        self.subscriber_buffer = subscriber_buffer
        self.data_parallel_rank = data_parallel_rank
        self._lock = threading.Lock()
        self._last_sequence_number = 0  # of the newest live batch; 0 before any
        self._retained: deque[KvEventBatch] = deque(maxlen=retained_batches)
        self._subscribers: list[KvEventSubscription] = []

    @property
    def last_sequence_number(self) -> int:
        return self._last_sequence_number

    def publish(self, events: list[KvEvent]) -> None:
        """One step's events (step thread)."""
        with self._lock:
            self._last_sequence_number += 1
            batch = KvEventBatch(self._last_sequence_number, time.time_ns(), self.data_parallel_rank, tuple(events))
            self._retained.append(batch)
            subscribers = list(self._subscribers)
        dropped = [s for s in subscribers if not self._delivered(s, batch)]
        if dropped:
            with self._lock:
                self._subscribers = [s for s in self._subscribers if s not in dropped]

    @staticmethod
    def _delivered(sub: KvEventSubscription, batch: KvEventBatch) -> bool:
        """Push ``batch`` to ``sub``; False when it ends there. A wake-up that raises (a server's
        event loop already closed) ends that subscription alone: it once ended ``publish`` before
        the subscribers after it, which then missed every batch without a failure (found by review)."""
        try:
            return sub._push(batch)
        except Exception:
            logger.exception("a KV event subscriber's wake-up failed: the subscription ends")
            sub.close()
            return False

    def subscribe(self, on_ready: Callable[[], None], snapshot: list[BlockStored] | None = None,
                  start_sequence_number: int = 0) -> KvEventSubscription:
        """Live from the next batch on, after either a snapshot (``snapshot``: the pool's
        published blocks, taken between steps) or a replay from ``start_sequence_number``
        (> 0). A replay point no longer retained ends the subscription at once."""
        sub = KvEventSubscription(self.subscriber_buffer, on_ready)
        with self._lock:
            last = self._last_sequence_number
            if snapshot is not None:
                sub._push(KvEventBatch(last, time.time_ns(), self.data_parallel_rank, tuple(snapshot), snapshot=True),
                          bounded=False)
            elif start_sequence_number > 0:
                oldest = self._retained[0].sequence_number if self._retained else last + 1
                if start_sequence_number > last + 1:
                    sub._fail(f"KV event replay from sequence number {start_sequence_number} is not possible: "
                              f"the newest batch is {last}")
                    return sub
                if start_sequence_number < oldest:
                    sub._fail(f"KV event replay from sequence number {start_sequence_number} is not possible: "
                              f"the oldest retained batch is {oldest} (--kv-events-retained-batches "
                              f"{self.retained_batches}); resubscribe with include_snapshot")
                    return sub
                for batch in self._retained:
                    if batch.sequence_number >= start_sequence_number:
                        sub._push(batch, bounded=False)
            self._subscribers.append(sub)
        return sub

    @property
    def num_subscribers(self) -> int:
        with self._lock:
            return len([s for s in self._subscribers if not s.closed])
