"""The Generate handler's writes (refengine/server/write_watch.py): a client that takes no write
after its stream's end is disconnected once the end is stall timeout + ABORT_CONFIRM_SECONDS
old, without cancelling the send; one still in its stream is waited for; a client cancel
takes the pending write with it. The real-server path: test_server_generate's stalled clients."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from refengine.server import write_watch
from refengine.server.stream_bridge import OutputBridge
from refengine.server.write_watch import WriteWatch

STALL_S, CONFIRM_S = 0.05, 0.2


class StuckContext:
    """A call whose client reads nothing: every write stays pending."""

    def __init__(self) -> None:
        self.writes: list[asyncio.Future] = []
        self.aborted: tuple[grpc.StatusCode, str] | None = None
        self.send_cancelled = False  # the first write's send, as the handler left it

    async def write(self, event: object) -> None:
        sent = asyncio.get_running_loop().create_future()
        self.writes.append(sent)
        await sent

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)


async def _handler(context: StuckContext, bridge: OutputBridge, ended: bool) -> None:
    watch = WriteWatch(context, bridge, asyncio.current_task())
    if ended:
        bridge.fail(write_watch.__name__)  # a failed stream (stalled, drained): its engine side ended now
    try:
        await watch.send(object())
    finally:
        watch.close()


def _run(ended: bool, wait_s: float, cancel: bool = False) -> tuple[StuckContext, str]:
    """The context and the handler's state (``running``, ``cancelled``, ``done``) ``wait_s`` after
    its write began (and a cancel, with ``cancel``), read before ``asyncio.run`` cancels what runs."""

    async def main() -> tuple[StuckContext, str]:
        context = StuckContext()
        bridge = OutputBridge(asyncio.get_running_loop(), "r", 4, STALL_S, lambda bridge: None)
        handler = asyncio.ensure_future(_handler(context, bridge, ended))
        await asyncio.sleep(wait_s)
        if cancel:
            handler.cancel()
        await asyncio.sleep(0.01)
        context.send_cancelled = context.writes[0].cancelled()
        return context, "cancelled" if handler.cancelled() else "done" if handler.done() else "running"

    return asyncio.run(main())


@pytest.fixture(autouse=True)
def short_confirm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(write_watch, "ABORT_CONFIRM_SECONDS", CONFIRM_S)
    monkeypatch.setattr(write_watch, "MIN_CHECK_SECONDS", 0.01)


def test_a_client_reading_nothing_after_the_end_is_disconnected_and_the_send_left_pending() -> None:
    context, handler = _run(ended=True, wait_s=STALL_S + CONFIRM_S + 2 * STALL_S + 0.1)
    assert handler == "cancelled"
    assert context.aborted is not None and context.aborted[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "read nothing" in context.aborted[1]
    assert not context.send_cancelled  # gRPC cannot take a send back mid-way


def test_a_stuck_write_before_the_end_is_waited_for() -> None:
    context, handler = _run(ended=False, wait_s=STALL_S + CONFIRM_S + 4 * STALL_S)
    assert handler == "running" and context.aborted is None  # the bridge's stall clock ends such a stream


def test_a_client_cancel_takes_the_pending_write_with_it() -> None:
    context, handler = _run(ended=True, wait_s=STALL_S, cancel=True)
    assert handler == "cancelled" and context.aborted is None
    assert context.send_cancelled
