"""A Generate stream's writes, and the one timer that disconnects a client that never reads again.

A client that takes none of a write while nothing more comes from the engine (its request
finished, or failed: stalled, drained) is disconnected once that end is ``stall_timeout`` +
``ABORT_CONFIRM_SECONDS`` old: room to resume reading and get the terminal event. Found by
review: such a stream, its client holding the connection but never reading again, stayed open
for good, and every drain waited the grace period and the flush for it.

One timer per stream checks every ``stall_timeout`` (at least MIN_CHECK_SECONDS), not a timer
and a wait around every write: those cost more server CPU than the write itself.

Invariants:
- a write is a future of its own, awaited through a shield: giving up on it ends the handler
  without cancelling the send, which gRPC cannot take back mid-way (``errors.disconnect``);
- the timer cancels the handler only while a write is pending, so the cancel lands in
  :meth:`WriteWatch.send`; any other cancel of the handler is the call's end (a client cancel),
  and the pending write goes with it.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from refengine.protocol import oe
from refengine.server.errors import disconnect
from refengine.server.stream_bridge import ABORT_CONFIRM_SECONDS, OutputBridge

logger = logging.getLogger(__name__)
#: The shortest period of the check: a stream's ``extra`` may set a stall timeout of a millisecond,
#: and a timer firing that often for the stream's whole life is the client's to impose on the server.
MIN_CHECK_SECONDS = 0.1


class WriteWatch:
    """The writes of one accepted stream, run by its handler task ``handler``; :meth:`close`
    when the handler ends."""

    def __init__(self, context: grpc.aio.ServicerContext, bridge: OutputBridge, handler: asyncio.Task) -> None:
        self._context, self._bridge, self._handler = context, bridge, handler
        self._loop = asyncio.get_running_loop()
        self._patience = bridge.stall_timeout + ABORT_CONFIRM_SECONDS
        self._write: asyncio.Future | None = None
        self._gave_up = False
        self._period = max(bridge.stall_timeout, MIN_CHECK_SECONDS)
        self._timer = self._loop.call_later(self._period, self._check)

    async def send(self, event: oe.GenerateResponse) -> None:
        write = self._write = asyncio.ensure_future(self._context.write(event))
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:
            if self._gave_up:
                disconnect(self._context, write, f"the client read nothing for over {self._patience:.0f} s after "
                           f"the stream's end (stall timeout {self._bridge.stall_timeout:g} s); disconnected")
            write.cancel()  # the call ended (a client cancel): the write goes with it
            raise

    def close(self) -> None:
        self._timer.cancel()

    def _check(self) -> None:
        ended_at = self._bridge.ended_at
        stuck = self._write is not None and not self._write.done()
        if stuck and ended_at is not None and self._loop.time() - ended_at >= self._patience:
            logger.warning("request %s: client read nothing for %.1f s after its stream ended; disconnecting it",
                           self._bridge.request_id, self._patience)
            self._gave_up = True
            self._handler.cancel()
            return
        self._timer = self._loop.call_later(self._period, self._check)
