"""Transfer threads shared fairly between sources.

A pull to a source that stopped answering (a stopped process: TCP still acknowledges) holds its
thread until the pull's timeout. On one plain pool, a few such pulls took every thread, and pulls
from healthy sources waited behind them, timeout after timeout (found by review: a request whose
KV was on a healthy prefill server waited 59 s behind one hung server; the same on embedding
handles behind one hung encoder).

``SourcePool`` runs at most ``num_threads - 1`` jobs of one source at once (all of them when there
is one thread), so a thread is always left for the other sources. A job past its source's limit
waits in that source's queue, holding no thread; the thread that ends a job of a source runs that
source's next waiting job, so the limit holds without resubmitting to the executor (which
``shutdown`` may already have closed). A job that waited ``max_wait_seconds`` there (the pull
timeout: the jobs ahead of it timed out, so would it) is handed a retryable failure to end with
at once, instead of waiting its whole timeout again.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from refengine.kv.transfer.base import TransferFailure
from refengine.types import KvEndpointSpec

#: Called with None to do its work, or with the failure to end with instead (it waited too long).
Job = Callable[[TransferFailure | None], None]


def source_of(endpoints: tuple[KvEndpointSpec, ...]) -> str:
    """The source a pull dials: its endpoints, as they are listed."""
    return ",".join(f"{e.host}:{e.port}" for e in endpoints)


class SourcePool:
    def __init__(self, num_threads: int, thread_name_prefix: str, max_wait_seconds: float, source_noun: str,
                 timeout_option: str) -> None:
        self.per_source = max(1, num_threads - 1)
        self._max_wait_seconds = max_wait_seconds
        self._source_noun, self._timeout_option = source_noun, timeout_option  # for the failure's message
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix=thread_name_prefix)
        self._lock = threading.Lock()
        self._running: dict[str, int] = defaultdict(int)  # jobs of a source on a thread now
        self._waiting: dict[str, deque[tuple[Job, float]]] = defaultdict(deque)  # (job, when it was queued)

    def submit(self, source: str, job: Job) -> None:
        """Run ``job`` (it must not raise) when its source has a free slot: ``job(None)``, or
        ``job(failure)`` when it waited ``max_wait_seconds`` for that slot."""
        with self._lock:
            if self._running[source] >= self.per_source:
                self._waiting[source].append((job, time.monotonic()))
                return
            self._running[source] += 1
        self._executor.submit(self._chain, source, (job, time.monotonic()))

    def _chain(self, source: str, queued: tuple[Job, float] | None) -> None:
        while queued is not None:
            job, since = queued
            job(self._late(time.monotonic() - since))
            with self._lock:
                waiting = self._waiting.get(source)
                queued = waiting.popleft() if waiting else None
                if not waiting:
                    self._waiting.pop(source, None)
                if queued is None:
                    self._running[source] -= 1
                    if not self._running[source]:
                        del self._running[source]

    def _late(self, waited: float) -> TransferFailure | None:
        if waited < self._max_wait_seconds:
            return None
        return TransferFailure("failed", f"waited {waited:.0f} s for a transfer thread behind other pulls from "
                               f"the same {self._source_noun} ({self._timeout_option})", retryable=True)

    def shutdown(self) -> None:
        """Wait for every job, the waiting ones included (the caller cancelled them: they end soon)."""
        self._executor.shutdown(wait=True)
