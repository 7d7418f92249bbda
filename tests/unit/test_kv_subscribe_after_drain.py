"""A SubscribeKvEvents accepted after the drain ended the subscribers (Control RPCs still answer
while DRAINING) ends at once with the retryable CANCELLED error too (X3, E5).

Found by review: it was never drained, so the drain's flush waited its whole bound (16 s) for it,
and it ended with the listener's cancel instead.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from refengine.engine.kv_events import KvEventHub
from refengine.protocol import oe
from refengine.server import kv_events_service


class Ctx:
    def __init__(self) -> None:
        self.written = []

    async def send_initial_metadata(self, md):  # noqa: ANN001
        pass

    async def write(self, response):  # noqa: ANN001
        self.written.append(response)

    async def abort(self, code, message):  # noqa: ANN001
        raise RuntimeError(code, message)


def test_a_subscription_made_after_the_drain_pass_is_drained_too() -> None:
    hub = KvEventHub(16, 16)
    engine = SimpleNamespace(info=SimpleNamespace(device="cpu"),
                             subscribe_kv_events=lambda on_ready, snapshot, start: hub.subscribe(on_ready))
    state = SimpleNamespace(engine=engine, engine_for_control=lambda: engine, kv_subscribers=set(),
                            drain_deadline_passed=False, options=SimpleNamespace(stall_timeout_seconds=5.0))

    async def main() -> tuple[str, list]:
        # Server._drain at the grace deadline: cut_off_streams(), then drain() every subscriber.
        state.drain_deadline_passed = True
        for subscriber in list(state.kv_subscribers):
            subscriber.drain()
        # a router resubscribes (to this still-listening instance) right after its DRAINED error
        ctx = Ctx()
        call = asyncio.ensure_future(kv_events_service.subscribe(state, oe.SubscribeKvEventsRequest(), ctx))
        try:
            await asyncio.wait_for(asyncio.shield(call), 2.0)
            return "ended", ctx.written
        except TimeoutError:
            left = len(state.kv_subscribers)
            call.cancel()
            return f"still open after 2 s ({left} in state.kv_subscribers: the flush waits for it)", ctx.written

    outcome, written = asyncio.run(main())
    assert outcome == "ended" and written and written[-1].error.code == oe.ERROR_CODE_CANCELLED, outcome
