"""Engine thread → event loop hand-off for one request's outputs.

The engine calls :meth:`OutputBridge.sink` on its own thread after every step; the sink
only schedules :meth:`_push` on the loop (``call_soon_threadsafe``), so the engine thread
never blocks and never runs gRPC code. The servicer awaits :meth:`next`.

Bounded delivery: ``capacity`` outputs may wait undelivered. When the buffer is full and
the consumer takes nothing for ``stall_timeout`` seconds (its gRPC writes are stuck behind
a client that does not read), ``on_stall`` runs once: the server aborts the engine request
and the stream ends with a terminal ``EngineError(OVERLOADED, retryable)``. Outputs beyond
``capacity`` still queue meanwhile (the engine must not block), so the overflow is bounded
by what the engine produces in one stall timeout. A client that reads nothing even then is
disconnected by the servicer (``write_watch.WriteWatch``), which ``ended_at`` times.

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
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from refengine.types import EngineFault, RequestOutput, Usage

# How long a failed stream waits for the engine's final usage (G16): the engine confirms an abort
# after the step in flight, and a CPU prefill step of 1,500 tokens took over 5 s on a loaded
# 2-core machine (the terminal EngineError then went out without its usage). Ends at the confirmation.
ABORT_CONFIRM_SECONDS = 15.0


class OutputBridge:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        request_id: str,
        capacity: int,
        stall_timeout: float,
        on_stall: Callable[[OutputBridge], None],
        release_session: Callable[[str], object] = lambda session_id: None,
    ) -> None:
        self.request_id = request_id
        self.capacity = capacity
        self.stall_timeout = stall_timeout
        self.engine_finished = False  # the engine's final output reached the loop
        self.engine_done = asyncio.Event()  # the engine retired the id (see id_released)
        self.on_engine_done: Callable[[], None] | None = None  # called then, on the loop
        self.failure: EngineFault | None = None
        self.ended_at: float | None = None  # loop time the engine side ended: finished, or failed
        self._loop = loop
        self._on_stall = on_stall
        self._pending: deque[RequestOutput] = deque()
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
            self._pending.append(out)
            if len(self._pending) >= self.capacity and not self.engine_finished:
                self._start_stall_clock()
        else:
            self._dropped_tokens += _num_tokens(out)
        self._wakeup.set()

    def abandon(self) -> None:
        """No client will read on: release the KV sessions of the outputs waiting and of any
        still to come."""
        self._abandoned = True
        self._stop_stall_clock()
        for out in self._pending:
            if out.prefill is not None:
                self._release_session(out.prefill.session_id)
        self._pending.clear()

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
        self._dropped_tokens += sum(_num_tokens(out) for out in self._pending)
        self._pending.clear()
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
                out = self._pending.popleft()
                self._stop_stall_clock()  # the consumer made progress
                if len(self._pending) >= self.capacity and not self.engine_finished:
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
