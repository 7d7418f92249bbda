"""Staging rows withheld after a pull that could not stop writing (``dest_may_change``) are
counted: a later handle that fits the arena but not what is left of it fails at once, saying why
(retryable: on another replica), and the pulls behind it go on.

Found by review: nothing counted them, so such a handle held a transfer thread for the whole pull
timeout, then failed "no staging memory came free in time", and every retry on this engine
repeated it, with every pull behind it waiting too.
"""

from __future__ import annotations

import time

from refengine.engine.media_pulls import MediaPulls
from refengine.kv.transfer.base import Cancellation, PullOrder, TransferFailure
from refengine.types import EmbeddingHandleSpec, EmbeddingTransferSpec, KvEndpointSpec
from tests.unit.test_media_pull_ids import HIDDEN, GatedRows, one_thread_pulls


class StuckOnH1(GatedRows):
    def pull(self, order: PullOrder, cancelled: Cancellation) -> None:
        if order.session.session_id == "h1":
            raise TransferFailure("failed", "the READ still runs", dest_may_change=True)
        super().pull(order, cancelled)


def handle(number: int, rows: int) -> EmbeddingHandleSpec:
    transfer = EmbeddingTransferSpec("grpc", (KvEndpointSpec("127.0.0.1", 1, "grpc"),))
    return EmbeddingHandleSpec(f"h{number}", f"{number:064x}", "refengine-rgb8-sha256", "image", (rows, HIDDEN),
                               "float32", "test", "fp", (transfer,))


def wait_finished(pulls: MediaPulls, deadline: float) -> tuple:
    while time.monotonic() < deadline:
        if done := pulls.take_finished():
            return done[0]
        time.sleep(0.01)
    raise AssertionError("no pull ended")


TIMEOUT = 3.0


def test_a_handle_larger_than_the_rows_left_after_withholding_fails_at_once_saying_why() -> None:
    pulls = one_thread_pulls(StuckOnH1(), num_rows=8, timeout_seconds=TIMEOUT)
    try:
        pulls.start("a", [handle(1, 4)])  # 4 of the 8 rows withheld until restart
        _, pulled, fault = wait_finished(pulls, time.monotonic() + 10)
        assert pulled is None and fault is not None
        started = time.monotonic()
        pulls.start("b", [handle(2, 6)])  # fits the arena (8), never what is left of it (4)
        _, pulled, fault = wait_finished(pulls, time.monotonic() + 10)
        waited = time.monotonic() - started
        assert pulled is None and fault is not None
        assert waited < TIMEOUT / 2, f"held a transfer thread {waited:.1f} s for rows that can never come"
        assert "withheld" in fault.message, "say why: retrying on this engine can never succeed"
    finally:
        pulls.shutdown()


def test_a_handle_that_can_never_fit_does_not_hold_up_the_pulls_behind_it() -> None:
    pulls = one_thread_pulls(StuckOnH1(), num_rows=8, timeout_seconds=TIMEOUT)
    try:
        pulls.start("a", [handle(1, 4)])
        wait_finished(pulls, time.monotonic() + 10)
        started = time.monotonic()
        pulls.start("b", [handle(2, 6)])  # never fits the 4 rows left
        pulls.start("c", [handle(3, 2)])  # fits at once
        ends: dict[str, float] = {}
        while len(ends) < 2 and time.monotonic() < started + 10:
            for request_id, _, _ in pulls.take_finished():
                ends[request_id] = time.monotonic() - started
            time.sleep(0.01)
        assert ends["c"] < TIMEOUT / 2, "a 2-row handle waited for a 6-row one that can never be pulled"
    finally:
        pulls.shutdown()
