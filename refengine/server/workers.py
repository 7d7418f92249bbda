"""The server's worker threads for blocking calls, in two pools, so that slow work never queues
the quick.

asyncio's default executor (``min(32, cpus + 4)`` threads: 6 on a 2-core machine) runs the short
calls the server must answer promptly: KvPull chunk reads, KV event subscriptions, LoRA loads,
Release, the encoder's health probe. Work that may wait for seconds runs on ``SlowWork`` instead:
accepting a Generate (tokenizing a long prompt, waiting for a grammar compile thread, fetching a
media URL) and an encoder's Encode. Found by review: six requests waiting for grammar compiles
held every default thread, and a decode server's KvPull of this prefill server waited behind them.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

#: Threads for slow work. Most of it waits (for a compile thread, for the network) rather than
#: computes, so threads are cheap; beyond this many at once, slow work queues here, behind its own kind.
SLOW_WORK_THREADS = 64


class SlowWork:
    def __init__(self, num_threads: int = SLOW_WORK_THREADS) -> None:
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="refengine-slow-work")

    def run(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """``fn(*args)`` on a slow-work thread (call from the event loop)."""
        return asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    def shutdown(self) -> None:
        """At exit: work not started is dropped; work under way finishes on its own."""
        self._executor.shutdown(wait=False, cancel_futures=True)
