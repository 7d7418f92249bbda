"""Transfer threads are shared fairly between sources (``kv/transfer/source_pool.py``). Found by
review: on one plain pool, pulls to a source that stopped answering took every thread, each until
its timeout, and a request whose KV (or embedding handle) was on a healthy source waited behind
them: 59 s behind one hung prefill server with the default 4 threads."""

from __future__ import annotations

import threading
import time

from refengine.engine.disagg import KvLoads
from refengine.kv.transfer.base import Cancellation, PullOrder, TransferFailure
from refengine.kv.transfer.source_pool import SourcePool
from refengine.types import KvEndpointSpec, KvSessionSpec
from tests.unit.test_media_pull_ids import GatedRows, handle, one_thread_pulls

WAIT = 10.0


def test_a_blocked_source_leaves_a_thread_for_the_others_and_keeps_its_order() -> None:
    pool = SourcePool(3, "test-pool", WAIT, "source", "--test-timeout")
    release, ran, running, most = threading.Event(), [], [0], [0]
    lock = threading.Lock()

    def blocked(index: int) -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        release.wait(WAIT)
        with lock:
            running[0] -= 1
            ran.append(f"a{index}")

    try:
        for index in range(5):
            pool.submit("hung:1", lambda late, index=index: blocked(index))
        healthy = threading.Event()
        pool.submit("healthy:2", lambda late: healthy.set())
        assert healthy.wait(WAIT / 2), "a healthy source's job waited behind a blocked one"
        release.set()
    finally:
        pool.shutdown()  # runs the waiting jobs too
    assert sorted(ran) == [f"a{index}" for index in range(5)], "a waiting job never ran"
    assert most[0] == 2 == pool.per_source, "one source ran more jobs at once than its share"


def test_one_thread_is_one_job_at_a_time() -> None:
    pool = SourcePool(1, "test-pool", WAIT, "source", "--test-timeout")
    done: list[str] = []
    for name in ("a", "b", "c"):
        pool.submit(f"{name}:1", lambda late, name=name: done.append(name))
    pool.shutdown()
    assert pool.per_source == 1 and done == ["a", "b", "c"]


class HungSource:
    """A transfer backend whose pulls from port 1 hang until cancelled or released."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def pull(self, order: PullOrder, cancelled: Cancellation) -> None:
        if order.session.endpoints[0].port == 1:
            while not (self.release.is_set() or cancelled.is_set()):
                time.sleep(0.01)
            if not self.release.is_set():
                raise TransferFailure("failed", "cancelled")


def order(request_id: str, port: int) -> PullOrder:
    session = KvSessionSpec(request_id, "test", (KvEndpointSpec("127.0.0.1", port, "grpc"),))
    return PullOrder(request_id, session, 0, (0,))


def test_a_pull_from_a_healthy_prefill_does_not_wait_for_a_hung_one() -> None:
    backend = HungSource()
    loads = KvLoads({"test": backend}, 4, lambda: None, 1, 30.0)
    try:
        for index in range(4):  # as many as there are transfer threads
            loads.start(order(f"hung{index}", 1))
        loads.start(order("healthy", 2))
        deadline, ended = time.monotonic() + WAIT / 2, []
        while "healthy" not in ended:
            assert time.monotonic() < deadline, "the healthy source's pull waited behind the hung source's"
            ended += [request_id for _, request_id, _ in loads.take_finished()]
            time.sleep(0.01)
        assert not any(rid.startswith("hung") for rid in ended)
        backend.release.set()
    finally:
        loads.shutdown()


class SlowSource:
    """A transfer backend whose every pull times out after ``seconds`` (a source that stopped)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def pull(self, order: PullOrder, cancelled: Cancellation) -> None:
        cancelled.wait(self.seconds)
        raise TransferFailure("failed", "timed out", retryable=True)


def test_a_pull_that_waited_its_timeout_for_a_thread_fails_at_once() -> None:
    """Found by review: pulls queued behind a hung source's waited for a thread, then their own
    whole timeout again (60 s with a 30 s timeout). A pull that already waited its timeout for a
    thread fails at once, retryable."""
    timeout = 1.0
    loads = KvLoads({"test": SlowSource(timeout)}, 2, lambda: None, 1, timeout)  # one at a time from a source
    try:
        started = time.monotonic()
        for index in range(4):
            loads.start(order(f"hung{index}", 1))
        ended: dict[str, float] = {}
        while len(ended) < 4 and time.monotonic() < started + 10 * timeout:
            for _, request_id, failure in loads.take_finished():
                assert failure is not None and failure.retryable
                ended[request_id] = time.monotonic() - started
            time.sleep(0.01)
        assert max(ended.values()) < 2.5 * timeout, f"queued pulls waited their timeout again: {ended}"
    finally:
        loads.shutdown()


def test_a_job_that_waited_the_longest_wait_is_handed_its_failure() -> None:
    """The pool, not each caller, turns a wait of ``max_wait_seconds`` into a retryable failure:
    the first job runs, the one queued behind it past the limit gets the failure instead."""
    pool = SourcePool(1, "test-pool", 0.2, "encoder", "--test-timeout")
    handed: list[TransferFailure | None] = []
    pool.submit("a:1", lambda late: (handed.append(late), time.sleep(0.3)))
    pool.submit("a:1", handed.append)
    pool.shutdown()
    assert handed[0] is None and handed[1] is not None and handed[1].retryable
    assert "the same encoder (--test-timeout)" in str(handed[1])


def test_an_embedding_pull_that_waited_its_timeout_for_a_thread_fails_at_once() -> None:
    """The same rule on the media path (``MediaPulls``): a handle pull queued behind a stuck
    encoder's for the whole --embedding-pull-timeout ends at once with a retryable fault."""
    backend = GatedRows()
    pulls = one_thread_pulls(backend, timeout_seconds=0.3)
    try:
        backend.gates["h1"] = threading.Event()  # holds the only transfer thread
        pulls.start("busy", [handle(1)])
        pulls.start("queued", [handle(2)])  # the same encoder: it waits for that thread
        time.sleep(0.5)
        backend.gates["h1"].set()
        ends: dict[str, tuple] = {}
        deadline = time.monotonic() + WAIT
        while len(ends) < 2:
            assert time.monotonic() < deadline, ends
            ends.update((request_id, (pulled, fault)) for request_id, pulled, fault in pulls.take_finished())
            time.sleep(0.01)
    finally:
        pulls.shutdown()
    assert ends["busy"][1] is None, "the pull on the thread ran to its end"
    pulled, fault = ends["queued"]
    assert pulled is None and fault is not None and fault.retryable and fault.code == "kv_transfer_failed"
    assert "behind other pulls from the same encoder (--embedding-pull-timeout)" in fault.message
    assert "h2" not in backend.started, "the late pull still dialled the encoder"
