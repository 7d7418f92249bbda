"""A request ended between steps (``EngineCore.fail_all``) after its media pull had finished but
before a step took that end: the end is dropped with the request, so a new request reusing the id
(G2) is never handed the old rows or the old failure.

Found by review: ``MediaPulls.cancel`` forgot only a pull still running. The new request took the
old pull's end, the step raised ``KeyError`` on its handle, and the engine stopped.
"""

from __future__ import annotations

import threading
import time

from refengine.kv.transfer.base import Cancellation, PullOrder
from tests.unit.test_encoder_engine import (  # noqa: F401 - llava: a fixture
    Loopback,
    consumer,
    items,
    llava,
    make_encoder,
    reachable,
    request,
)
from tests.unit.test_media_pull_ids import GatedRows, handle, one_thread_pulls


def test_a_cancelled_pull_that_already_ended_is_not_handed_to_the_id_s_next_request() -> None:
    backend = GatedRows()
    pulls = one_thread_pulls(backend)
    try:
        pulls.start("r", [handle(2)])
        deadline = time.monotonic() + 10
        while not pulls._finished:  # h2's pull ended; the core has not taken it yet
            assert time.monotonic() < deadline
            time.sleep(0.01)
        pulls.cancel("r")  # fail_all ended "r" (its terminal output went out: the id is free)
        backend.gates["h3"] = threading.Event()
        pulls.start("r", [handle(3)])  # the client's new request under the same id
        taken = pulls.take_finished()  # the next step's _attach_pulled_media
        backend.gates["h3"].set()
    finally:
        pulls.shutdown()
    stale = [(rid, sorted(pulled or {})) for rid, pulled, _ in taken]
    assert not stale, f"the new 'r' was handed the cancelled pull's end: {stale}"


def test_engine_level_a_reused_id_after_fail_all_is_not_handed_the_old_pull(llava) -> None:  # noqa: ANN001, F811
    gate = threading.Event()

    class Gated(Loopback):
        def pull(self, order: PullOrder, cancelled: Cancellation) -> None:
            assert gate.wait(10)  # held until the step that started it has ended
            super().pull(order, cancelled)

    encoder = make_encoder(llava.directory)
    engine = consumer(llava.directory, encoder, source=Gated)
    try:
        old = reachable(encoder.encode(items(0)))
        first = engine.add_request(request("r", 1, media_handles=old))
        engine.step()  # admitted: its handle is pulled on a transfer thread
        gate.set()
        pulls = engine.core.media_pulls
        deadline = time.monotonic() + 10
        while not pulls._finished:  # the pull ended; no step took it yet
            assert time.monotonic() < deadline
            time.sleep(0.01)
        engine.fail_all("engine fault: a step raised")  # what the loop's _end_all does
        assert first.result(timeout=1).error is not None
        new = reachable(encoder.encode(items(1)))
        second = engine.add_request(request("r", 1, media_handles=new))  # G2: the id is free again
        while not second.finished:
            engine.step()
            time.sleep(0.01)
        assert second.result().error is None, second.result().error
    finally:
        engine.shutdown()
        encoder.shutdown()
