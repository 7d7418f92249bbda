"""Engine thread → event loop hand-off for one request's outputs.

The engine calls :meth:`OutputBridge.sink` on its own thread after every step; the sink
only schedules :meth:`_push` on the loop (``call_soon_threadsafe``), so the engine thread
never blocks and never runs gRPC code. The servicer awaits :meth:`next`.

Bounded delivery: ``capacity`` outputs, and ``buffer_bytes`` of their estimated memory
(``held_bytes``), may wait undelivered. When the buffer is full and the consumer takes nothing
for ``stall_timeout`` seconds (its gRPC writes are stuck behind a client that does not read),
``on_stall`` runs once: the server aborts the engine request and the stream ends with a
terminal ``EngineError(OVERLOADED, retryable)``. Outputs beyond the buffer still queue meanwhile
(the engine must not block). A client that reads, but slower than the engine produces, restarts
the stall clock with every output it takes, so its backlog could grow to the end of the request
(found by review: one client asking for ``all`` candidates and reading nothing grew the server
by 2.5 GB within the 30 s stall timeout): when what waits behind the next output to send
passes ``OVERFLOW_FACTOR`` times ``buffer_bytes``, ``on_stall`` runs at once, with ``outrun``
set. A client that reads nothing even after the end is disconnected by the servicer
(``write_watch.WriteWatch``), which ``ended_at`` times.

Invariants:
- :meth:`next` returns each engine output once, in order; after a failure (:meth:`fail`)
  it returns one synthesized terminal output (``error`` set, the engine's usage) and the
  buffered outputs are dropped;
- a failure never replaces an outcome the engine already reached (``engine_finished``);
- the stall clock runs only while the engine request is still active;
- a KV session (a prefill server's ``PrefillReady``) that no client will be handed is released
  through ``release_session`` at once: one that arrives after a failure, or once the stream gave
  up (:meth:`abandon`: its client left before the terminal event was built). Without
  this, a client cancelling during its last prefill step left the prompt's blocks held by a
  session nobody knew, until its lease ended (found by review: 94 of 128 blocks for 30 s; K7).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from refengine.types import EngineFault, RequestOutput, Usage

# How long a failed stream waits for the engine's final usage (G16): the engine confirms an abort
# after the step in flight, and a CPU prefill step of 1,500 tokens took over 5 s on a loaded
# 2-core machine (the terminal EngineError then went out without its usage). Ends at the confirmation.
ABORT_CONFIRM_SECONDS = 15.0

#: What an undelivered output holds in memory, estimated from its parts: measured with tracemalloc
#: (2026-12-07), a ``Candidate`` with its int, float and rank is about 184 bytes. Candidates dominate
#: at scale: an ``all`` request makes one per vocabulary entry and token (SmolLM2: 49,152, ~9 MiB).
OUTPUT_BYTES, TOKEN_BYTES, CANDIDATE_BYTES = 512, 256, 192
#: Past this many times ``buffer_bytes`` undelivered, a stream ends at once (see the module's doc).
OVERFLOW_FACTOR = 4


class OutputBridge:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        request_id: str,
        capacity: int,
        stall_timeout: float,
        on_stall: Callable[[OutputBridge], None],
        release_session: Callable[[str], object] = lambda session_id: None,
        buffer_bytes: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.capacity = capacity
        self.buffer_bytes = buffer_bytes  # None: bounded by the number of outputs only
        self.outrun = False  # on_stall ran because the backlog passed OVERFLOW_FACTOR x buffer_bytes
        self.stall_timeout = stall_timeout
        self.engine_finished = False  # the engine's final output reached the loop
        self.engine_done = asyncio.Event()  # the engine retired the id (see id_released)
        self.on_engine_done: Callable[[], None] | None = None  # called then, on the loop
        self.failure: EngineFault | None = None
        self.ended_at: float | None = None  # loop time the engine side ended: finished, or failed
        self._loop = loop
        self._on_stall = on_stall
        self._pending: deque[tuple[RequestOutput, int]] = deque()  # each with its held_bytes
        self._pending_bytes = 0
        self._wakeup = asyncio.Event()
        self._stall_timer: asyncio.TimerHandle | None = None
        self._final_usage: Usage | None = None
        self._terminal_returned = False
        self._release_session = release_session
        self._abandoned = False  # no output will reach a client any more
        self._dropped_tokens = 0  # output tokens the engine counted that the client is never sent (after fail)

    # -- engine thread ----------------------------------------------------------
    def sink(self, out: RequestOutput) -> None:
        """The engine's ``OutputSink``: never blocks, never raises."""
        try:
            self._loop.call_soon_threadsafe(self._push, out)
        except RuntimeError:  # the loop is closed: the server is gone, nobody reads
            pass

    # -- event loop -------------------------------------------------------------
    def _push(self, out: RequestOutput) -> None:
        if out.finished:
            self.engine_finished = True
            self.ended_at = self.ended_at or self._loop.time()
            self.id_released()
            self._final_usage = out.usage
            self._stop_stall_clock()
        if out.prefill is not None and (self.failure is not None or self._abandoned):
            self._release_session(out.prefill.session_id)  # its PrefillReady will never be sent
        elif self.failure is None and not self._abandoned:
            size = held_bytes(out)
            self._pending.append((out, size))
            self._pending_bytes += size
            if not self.engine_finished:
                self._check_backlog()
        else:
            self._dropped_tokens += _num_tokens(out)
        self._wakeup.set()

    def abandon(self) -> None:
        """No client will read on: release the KV sessions of the outputs waiting and of any
        still to come."""
        self._abandoned = True
        self._stop_stall_clock()
        for out, _ in self._pending:
            if out.prefill is not None:
                self._release_session(out.prefill.session_id)
        self._clear_pending()

    def _check_backlog(self) -> None:
        """An output queued: the stall clock runs while the buffer is full, and ``on_stall`` runs
        now (once) when what waits behind the next output to send passes the overflow. Not the next
        one itself: a single output larger than the overflow is what the request asked for (its
        size was checked against the message limit before acceptance), not a client falling behind."""
        behind_next = self._pending_bytes - self._pending[0][1]
        if self.buffer_bytes is not None and behind_next >= self.overflow_bytes and not self.outrun:
            self.outrun = True
            self._stop_stall_clock()
            self._on_stall(self)
        elif self._full():
            self._start_stall_clock()

    @property
    def overflow_bytes(self) -> int:
        """The backlog at which the stream ends at once (``buffer_bytes`` must be set)."""
        assert self.buffer_bytes is not None
        return OVERFLOW_FACTOR * self.buffer_bytes

    def _full(self) -> bool:
        return len(self._pending) >= self.capacity or (
            self.buffer_bytes is not None and self._pending_bytes >= self.buffer_bytes)

    def _clear_pending(self) -> None:
        self._pending.clear()
        self._pending_bytes = 0

    def id_released(self) -> None:
        """The engine holds the request id no more: it finished the request, or it never
        accepted it (an add the client had left during). A request reusing the id may go (G2)."""
        self.engine_done.set()
        if self.on_engine_done is not None:
            self.on_engine_done()

    def _start_stall_clock(self) -> None:
        if self._stall_timer is None:
            self._stall_timer = self._loop.call_later(self.stall_timeout, self._stalled)

    def _stop_stall_clock(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _stalled(self) -> None:
        self._stall_timer = None
        if not self.engine_finished and self.failure is None:
            self._on_stall(self)

    def fail(self, fault: EngineFault) -> bool:
        """End the stream with ``fault`` (stall, drain). False when the engine already
        finished the request (its own outcome stands) or a failure was already set."""
        if self.engine_finished or self.failure is not None or self._terminal_returned:
            return False
        self.failure = fault
        self.ended_at = self._loop.time()
        self._dropped_tokens += sum(_num_tokens(out) for out, _ in self._pending)
        self._clear_pending()
        self._stop_stall_clock()
        self._wakeup.set()
        return True

    async def next(self) -> RequestOutput:
        """The next output to send; after a failure, the terminal one (once the engine
        confirmed the abort, so its usage is final)."""
        while True:
            if self.failure is not None:
                return await self._terminal_failure()
            if self._pending:
                out, size = self._pending.popleft()
                self._pending_bytes -= size
                self._stop_stall_clock()  # the consumer made progress
                if self._full() and not self.engine_finished:
                    self._start_stall_clock()
                if out.finished:
                    self._terminal_returned = True
                return out
            self._wakeup.clear()
            await self._wakeup.wait()

    async def _terminal_failure(self) -> RequestOutput:
        deadline = self._loop.time() + ABORT_CONFIRM_SECONDS
        while not self.engine_finished and self._loop.time() < deadline:
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), deadline - self._loop.time())
            except TimeoutError:
                break  # report the failure anyway; usage is then unknown
        self._terminal_returned = True
        usage = self._final_usage
        if usage is not None and self._dropped_tokens:  # G11/G16: the usage of what the client was sent
            usage = replace(usage, completion_tokens=max(0, usage.completion_tokens - self._dropped_tokens))
        return RequestOutput(self.request_id, finished=True, usage=usage, error=self.failure)

    def close(self) -> None:
        self._stop_stall_clock()


def _num_tokens(out: RequestOutput) -> int:
    return sum(len(delta.tokens) for delta in out.deltas)


def held_bytes(out: RequestOutput) -> int:
    """``out``'s estimated memory while it waits (the constants above)."""
    infos = itertools.chain.from_iterable((*(delta.tokens for delta in out.deltas), out.prompt_tokens or ()))
    return OUTPUT_BYTES + sum(TOKEN_BYTES + CANDIDATE_BYTES * len(info.candidates) for info in infos)
