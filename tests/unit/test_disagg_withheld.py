"""A decode request cancelled while its pull runs, whose pull then cannot stop writing
(``TransferFailure.dest_may_change``): its blocks are withheld until restart, and counted so.

Found by review: ``cancel_receiving`` handed the blocks to a ``load:`` owner and, when the pull
ended unstoppable, that owner kept them for good without ``num_withheld_blocks`` knowing. The
scheduler's check for a request the pool can never hold (``num_usable_blocks``) then saw the
whole pool, so such a request waited at the head of the queue forever, and every request behind
it. The prefix-cache head, which the pull never writes, was held for good too. A server's drain
waited its whole flush bound for the withheld blocks to come back.
"""

from __future__ import annotations

import random
import threading
import time
from functools import partial
from types import SimpleNamespace

from refengine.kv.transfer.base import Cancellation, PullOrder, TransferFailure
from refengine.server.state import ServerState
from tests.unit.test_disagg_engine import BLOCK, VOCAB, InProcessPull, add_disaggregated, make_engine, tiny  # noqa: F401


class UnstoppableOnceCancelled(InProcessPull):
    """The second pull waits for its cancel, then ends as a pull whose READ still runs."""

    def __init__(self, source) -> None:  # noqa: ANN001
        super().__init__(source)
        self.stuck = threading.Event()

    def pull(self, order: PullOrder, cancelled: Cancellation) -> None:
        if self.num_pulls == 1:
            self.num_pulls += 1
            self.stuck.set()
            cancelled.wait(30)
            raise TransferFailure("failed", "cancelled: the READ still runs", dest_may_change=True)
        super().pull(order, cancelled)


def test_a_cancelled_pull_that_cannot_stop_withholds_its_blocks(tiny) -> None:  # noqa: F811
    prefill = make_engine(tiny, "prefill")
    backend = UnstoppableOnceCancelled(prefill)
    decode = make_engine(tiny, "decode", backend, num_blocks=10)
    prefill.start()
    decode.start()
    rng = random.Random(3)
    head = [rng.randrange(3, VOCAB) for _ in range(3 * BLOCK)]
    try:
        disaggregated = partial(add_disaggregated, prefill, decode)

        assert disaggregated("cached", head, 2).result(30).error is None  # its 3 blocks stay cached
        stuck = disaggregated("stuck", head + [rng.randrange(3, VOCAB) for _ in range(4 * BLOCK)], 2)
        assert backend.stuck.wait(30)
        decode.abort("stuck")
        assert stuck.result(30).outputs[0].finish.reason.value == "cancelled"
        deadline = time.monotonic() + 10
        while decode.core.kv.num_withheld_blocks == 0 and time.monotonic() < deadline:
            time.sleep(0.02)  # the pull's end is taken between steps
        kv = decode.core.kv
        assert kv.owners == ("load:stuck",)
        assert kv.num_withheld_blocks == 4 and kv.num_usable_blocks == 6, "the 4 pulled blocks, not the head"
        assert decode.stats().used_kv_blocks == decode.stats().withheld_kv_blocks == 4
        assert ServerState.flushed(SimpleNamespace(streams=set(), accepting=0, kv_subscribers=set(), engine=decode,
                                                   engine_error=None)), \
            "a drain does not wait for blocks that never come back"
        too_long = disaggregated("long", [rng.randrange(3, VOCAB) for _ in range(30)], 8)  # 10 blocks > 6
        behind = disaggregated("behind", [rng.randrange(3, VOCAB) for _ in range(8)], 4)
        ended = too_long.result(10)
        assert ended.error is not None and ended.error.code == "overloaded" and ended.error.retryable, ended
        assert behind.result(10).error is None
        decode.core.check_idle()
    finally:
        prefill.shutdown()
        decode.shutdown()
