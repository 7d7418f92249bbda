"""Transfer threads are shared fairly between sources (``kv/transfer/source_pool.py``). Found by
review: on one plain pool, pulls to a source that stopped answering took every thread, each until
its timeout, and a request whose KV (or embedding handle) was on a healthy source waited behind
them: 59 s behind one hung prefill server with the default 4 threads."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import torch

from refengine.engine.disagg import KvLoads
from refengine.engine.media_pulls import MediaPulls
from refengine.kv.transfer.base import Cancellation, PullOrder, TransferFailure
from refengine.kv.transfer.source_pool import SourcePool
from refengine.model.embedding_io import EmbeddingArena
from refengine.types import EmbeddingHandleSpec, EmbeddingTransferSpec, KvEndpointSpec, KvSessionSpec
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


def handle_on(number: int, port: int) -> EmbeddingHandleSpec:
    """``handle(number)``, held by the encoder at ``port``."""
    transfer = EmbeddingTransferSpec("grpc", (KvEndpointSpec("127.0.0.1", port, "grpc"),))
    return replace(handle(number), transfers=(transfer,))


def test_a_request_with_handles_on_two_encoders_counts_toward_each_encoders_share() -> None:
    """Found by review: a request's handles on a hung encoder and a healthy one were queued under
    their combined key, outside either encoder's limit, so with 2 threads a hung-only request and a
    mixed one held both and a healthy-only request waited for the hung encoder. Now the mixed
    request's part on the hung encoder queues behind the hung encoder's share, and its healthy
    part and the healthy-only request run."""
    backend = GatedRows()
    staging = EmbeddingArena(16, 4, torch.float32)
    backend.bind(staging, lambda handle_id, pulled: None)
    pulls = MediaPulls({"grpc": backend}, staging, num_threads=2, timeout_seconds=WAIT, on_done=lambda: None,
                       dtype=torch.float32, device="cpu")
    hung = threading.Event()
    backend.gates.update(h1=hung, h2=hung)  # the encoder at port 1 holds every pull
    try:
        pulls.start("hung-only", [handle_on(1, 1)])
        pulls.start("mixed", [handle_on(2, 1), handle_on(3, 2)])
        pulls.start("healthy-only", [handle_on(4, 2)])
        ends: dict[str, tuple] = {}
        deadline = time.monotonic() + WAIT / 2
        while "healthy-only" not in ends:
            assert time.monotonic() < deadline, f"a healthy encoder's pull waited for a hung one: {ends}"
            ends.update((request_id, (pulled, fault)) for request_id, pulled, fault in pulls.take_finished())
            time.sleep(0.01)
        assert "h3" in backend.started, "the mixed request's handle on the healthy encoder was not pulled"
        assert set(ends) == {"healthy-only"}, "a request with a handle on the hung encoder ended early"
        hung.set()
        while len(ends) < 3:
            assert time.monotonic() < deadline + WAIT, ends
            ends.update((request_id, (pulled, fault)) for request_id, pulled, fault in pulls.take_finished())
            time.sleep(0.01)
    finally:
        hung.set()
        pulls.shutdown()
    pulled, fault = ends["mixed"]
    assert fault is None and pulled is not None and set(pulled) == {"h2", "h3"}, "both parts' rows, together"
    assert torch.equal(pulled["h3"], torch.full((2, 4), 3.0))


class SplitOutcome(GatedRows):
    """The encoder at port 1 times out (retryable) once the handle at port 2 was pulled, or
    waits until cancelled when ``port1_waits``; the one at port 2 fails at once when ``port2_fails``."""

    def __init__(self, port1_waits: bool = False, port2_fails: bool = False) -> None:
        super().__init__()
        self.port1_waits, self.port2_fails = port1_waits, port2_fails
        self.port2_pulled = threading.Event()

    def pull(self, order: PullOrder, cancelled: Cancellation) -> None:
        if order.session.endpoints[0].port == 2:
            if self.port2_fails:
                raise TransferFailure("not_found", "gone")
            super().pull(order, cancelled)
            self.port2_pulled.set()
            return
        if self.port1_waits:
            cancelled.wait(WAIT)
            raise TransferFailure("failed", "cancelled" if cancelled.is_set() else "timed out", retryable=True)
        self.port2_pulled.wait(WAIT)
        raise TransferFailure("failed", "timed out", retryable=True)


def mixed_pull_end(backend: GatedRows) -> tuple[tuple, float]:
    """Pull one request with a handle on each encoder; its (pulled, fault) and the seconds it took."""
    staging = EmbeddingArena(16, 4, torch.float32)
    backend.bind(staging, lambda handle_id, pulled: None)
    pulls = MediaPulls({"grpc": backend}, staging, num_threads=3, timeout_seconds=WAIT, on_done=lambda: None,
                       dtype=torch.float32, device="cpu")
    started = time.monotonic()
    try:
        pulls.start("mixed", [handle_on(1, 1), handle_on(2, 2)])
        while not (ends := pulls.take_finished()):
            assert time.monotonic() < started + WAIT, "the request's pull never ended"
            time.sleep(0.01)
    finally:
        pulls.shutdown()
    assert len(ends) == 1 and ends[0][0] == "mixed"
    return ends[0][1:], time.monotonic() - started


def test_a_part_that_fails_after_another_encoders_handle_was_pulled_is_not_retryable() -> None:
    """ENC13: the handle pulled from the other encoder was consumed, so the same request cannot succeed."""
    (pulled, fault), _ = mixed_pull_end(SplitOutcome())
    assert pulled is None and fault is not None and fault.code == "kv_transfer_failed"
    assert not fault.retryable and "1 handle(s) of this request were pulled" in fault.message


def test_a_part_that_fails_stops_the_other_encoders_part() -> None:
    """The request fails with the first part's fault, at once, not when the stuck part times out."""
    (pulled, fault), seconds = mixed_pull_end(SplitOutcome(port1_waits=True, port2_fails=True))
    assert pulled is None and fault is not None and "gone" in fault.message and not fault.retryable
    assert seconds < WAIT / 2, f"the failed request waited {seconds:.1f} s for its other part"
