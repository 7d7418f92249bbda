"""The gRPC KV pull client (decode side, also the consumer of embedding handles) against a
KvPull server on loopback that misbehaves: a source that never sends a chunk must not hold a
transfer thread once the request is cancelled (ENC13, K8), and answers after which the same
pull can never succeed are not retryable."""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from refengine.kv.transfer.base import SESSION_CONTENT_KEY, Cancellation, PullOrder, TransferFailure, content_digest
from refengine.protocol.kvpull.v1 import kv_pull_pb2 as pb
from refengine.protocol.kvpull.v1 import kv_pull_pb2_grpc as pb_grpc
from refengine.server.kv_pull_client import MAX_CACHED_SOURCES, GrpcKvTransfer
from refengine.types import KvEndpointSpec, KvSessionSpec
from tests.refused_ports import refused_port

PULL_TIMEOUT_S = 30.0


class _Store:
    layout, dtype, regions, block_nbytes = "test-layout", "float32", (), 16

    def read(self, block_ids: Any) -> bytes:
        raise AssertionError("the decode side only writes")

    def write(self, block_ids: Any, data: Any) -> None:
        raise AssertionError("no chunk is ever sent here")


class _Source(pb_grpc.KvPullServicer):
    """Pull never sends a chunk (a stalled source) or aborts with ``code``; ``holds``: what it
    says the session holds (None: no headers)."""

    def __init__(self, code: grpc.StatusCode | None = None, holds: str | None = None) -> None:
        self.code, self.holds = code, holds
        self.pull_ended = threading.Event()

    def Pull(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:  # noqa: N802
        context.add_callback(self.pull_ended.set)
        if self.holds is not None:  # "": headers that say something else
            said = ((SESSION_CONTENT_KEY, content_digest(self.holds)),) if self.holds else (("x-other", "1"),)
            context.send_initial_metadata(said)
        if self.code is not None:
            context.abort(self.code, f"answered {self.code.name}")
        while context.is_active():
            time.sleep(0.01)
        yield from ()


def _serve(source: _Source) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_KvPullServicer_to_server(source, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def _order(port: int, content: str = "") -> PullOrder:
    session = KvSessionSpec("s-1", "grpc", (KvEndpointSpec(host="127.0.0.1", port=port, protocol="grpc"),))
    return PullOrder("r-1", session, 0, (0, 1), content=content)


def test_a_cancel_ends_a_pull_blocked_on_a_silent_source() -> None:
    source = _Source()
    server, port = _serve(source)
    transfer = GrpcKvTransfer(PULL_TIMEOUT_S)
    transfer.bind(_Store(), lambda *_: None)
    cancelled = Cancellation()
    threading.Timer(0.3, cancelled.set).start()
    started = time.monotonic()
    try:
        with pytest.raises(TransferFailure):
            transfer.pull(_order(port), cancelled)
        took = time.monotonic() - started
        assert source.pull_ended.wait(5.0), "the source's Pull was never cancelled"
    finally:
        transfer.close()
        server.stop(0)
    assert took < 5.0, f"the pull held its thread {took:.1f} s after the cancel (timeout {PULL_TIMEOUT_S:g} s)"


@pytest.mark.parametrize(("code", "retryable"), [
    (grpc.StatusCode.FAILED_PRECONDITION, False),  # holds no sessions: loading after a restart, or another role
    (grpc.StatusCode.UNIMPLEMENTED, False),  # not a KvPull server at all
    (grpc.StatusCode.INVALID_ARGUMENT, False),
    (grpc.StatusCode.INTERNAL, True),  # the source may still hold the session
    (grpc.StatusCode.RESOURCE_EXHAUSTED, True),
])
def test_answers_that_can_never_succeed_are_not_retryable(code: grpc.StatusCode, retryable: bool) -> None:
    server, port = _serve(_Source(code))
    transfer = GrpcKvTransfer(PULL_TIMEOUT_S)
    transfer.bind(_Store(), lambda *_: None)
    try:
        with pytest.raises(TransferFailure) as failure:
            transfer.pull(_order(port), Cancellation())
    finally:
        transfer.close()
        server.stop(0)
    assert failure.value.retryable is retryable and code.name in str(failure.value)


@pytest.mark.parametrize(("holds", "says"), [
    ("sha256:" + "b" * 64, "the source holds another item"),  # a handle whose mm_hash was changed
    ("", "its source did not say what it holds"),  # not a refengine source: nothing to trust
])
def test_rows_of_another_item_are_refused(holds: str, says: str) -> None:
    """ENC8: the consumer keys its prefix cache by the handle's identity, so the session must hold
    that item; anything else fails the pull before a row is written, not retryable."""
    source = _Source(holds=holds)
    server, port = _serve(source)
    transfer = GrpcKvTransfer(PULL_TIMEOUT_S)
    transfer.bind(_Store(), lambda *_: None)
    try:
        with pytest.raises(TransferFailure) as failure:
            transfer.pull(_order(port, content="sha256:" + "a" * 64), Cancellation())
    finally:
        transfer.close()
        server.stop(0)
    assert says in str(failure.value) and not failure.value.retryable


class _SlowSource(pb_grpc.KvPullServicer):
    """Sends block 0, waits for ``gate``, then block 1 (16 bytes each); Release answers."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.first_sent = threading.Event()

    def Pull(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:  # noqa: N802
        for index in range(2):
            if index == 1:
                self.gate.wait(10.0)
            data = bytes([index + 1]) * 16
            yield pb.KvChunk(first_block_index=index, num_blocks=1, data=data, crc32=zlib.crc32(data))
            self.first_sent.set()

    def Release(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        return pb.SessionReply(num_blocks=2)


class _WrittenStore(_Store):
    def __init__(self) -> None:
        self.written: list[tuple[Any, bytes]] = []

    def write(self, block_ids: Any, data: Any) -> None:
        self.written.append((tuple(block_ids), bytes(data)))


def test_channels_to_client_named_sources_are_bounded_and_a_running_pull_outlives_its_eviction() -> None:
    """Found by review: a session's endpoint is named by the client, and every name sent kept a
    channel for the server's life. Now the least recently used beyond MAX_CACHED_SOURCES is
    dropped; a pull still running on a dropped channel completes."""
    source = _SlowSource()
    server, port = _serve(source)
    store = _WrittenStore()
    transfer = GrpcKvTransfer(PULL_TIMEOUT_S)
    transfer.bind(store, lambda *_: None)
    try:
        pulling = futures.ThreadPoolExecutor(1).submit(transfer.pull, _order(port), Cancellation())
        assert source.first_sent.wait(10.0)
        for other in range(MAX_CACHED_SOURCES + 6):  # closed ports: each pin fails, its channel is kept
            session = KvSessionSpec("s-x", "grpc", (KvEndpointSpec(host="127.0.0.2", port=1 + other, protocol="grpc"),))
            transfer.start_pin(session, 1.0)
        assert len(transfer._sources) == MAX_CACHED_SOURCES
        source.gate.set()
        pulling.result(timeout=10.0)
        assert [data[0] for _, data in store.written] == [1, 2]
        source.gate.set()
        transfer.pull(_order(port), Cancellation())  # the source again: a fresh channel
        assert len(store.written) == 4
    finally:
        transfer.close()
        server.stop(0)


def test_a_connection_error_s_details_go_to_the_log_not_the_client(caplog: pytest.LogCaptureFixture) -> None:
    """Found by review: the client saw gRPC's connection error ("Connection refused", "Failed
    parsing HTTP/2") for the endpoint it named, telling it what listens there. A source's own
    answer (NOT_FOUND: the session is gone) still reaches it."""
    transfer = GrpcKvTransfer(PULL_TIMEOUT_S)
    transfer.bind(_Store(), lambda *_: None)
    server, port = _serve(_Source(grpc.StatusCode.NOT_FOUND))
    try:
        with refused_port() as closed_port, pytest.raises(TransferFailure) as refused:
            transfer.pull(_order(closed_port), Cancellation())
        with pytest.raises(TransferFailure, match="answered NOT_FOUND"):
            transfer.pull(_order(port), Cancellation())
    finally:
        transfer.close()
        server.stop(0)
    told = str(refused.value)
    assert "UNAVAILABLE" in told and "see the server's log" in told and "onnect" not in told, told
    assert any("onnect" in record.getMessage() for record in caplog.records), caplog.text


def test_an_ipv6_source_named_without_brackets_is_dialed() -> None:
    """Found by review: ``::1`` and a port made the target ``::1:PORT``, which gRPC cannot read
    (the source allow-list takes IPv6 hosts with or without brackets)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_KvPullServicer_to_server(_Source(grpc.StatusCode.NOT_FOUND), server)
    port = server.add_insecure_port("[::1]:0")
    if not port:
        pytest.skip("no IPv6 loopback here")
    server.start()
    transfer = GrpcKvTransfer(PULL_TIMEOUT_S)
    transfer.bind(_Store(), lambda *_: None)
    session = KvSessionSpec("s-1", "grpc", (KvEndpointSpec(host="::1", port=port, protocol="grpc"),))
    try:
        with pytest.raises(TransferFailure, match="answered NOT_FOUND"):  # it reached the source
            transfer.pull(PullOrder("r-1", session, 0, (0, 1)), Cancellation())
    finally:
        transfer.close()
        server.stop(0)


class _SilentPin(_Source):
    """Pin never answers (a source that stopped)."""

    def __init__(self) -> None:
        super().__init__()
        self.pin_ended = threading.Event()

    def Pin(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        context.add_callback(self.pin_ended.set)
        while context.is_active():
            time.sleep(0.01)
        return pb.SessionReply()


def test_a_cancel_ends_a_pin_waiting_on_a_silent_source() -> None:
    """Found by review: a NIXL pull's pin was not tied to the pull's cancel, so a cancelled
    request held its transfer thread until the pin timed out (18.6 s of 20 on a hung source)."""
    source = _SilentPin()
    server, port = _serve(source)
    transfer = GrpcKvTransfer(PULL_TIMEOUT_S)
    transfer.bind(_Store(), lambda *_: None)
    cancelled = Cancellation()
    try:
        outcome = transfer.start_pin(_order(port).session, 5.0, cancelled=cancelled)
        threading.Timer(0.3, cancelled.set).start()
        started = time.monotonic()
        with pytest.raises(TransferFailure, match="cancelled"):
            outcome()
        took = time.monotonic() - started
        assert source.pin_ended.wait(5.0), "the source's Pin was never cancelled"
    finally:
        transfer.close()
        server.stop(0)
    assert took < 5.0, f"the pin held its thread {took:.1f} s after the cancel (timeout {PULL_TIMEOUT_S:g} s)"


class _ShortPin(_Source):
    """Pin grants less than asked, as a source with a shorter --kv-pull-timeout does; or says nothing."""

    def __init__(self, granted: float) -> None:
        super().__init__()
        self.granted = granted

    def Pin(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        return pb.SessionReply(num_blocks=2, pinned_seconds=self.granted)


@pytest.mark.parametrize("granted,expected", [(0.5, 0.5), (0.0, 5.0)], ids=["granted", "unsaid"])
def test_a_pin_says_until_when_it_holds(granted: float, expected: float) -> None:
    """K10: the outcome is the time the source's pin surely holds until: from the sending, the seconds
    the source granted (a READ ending later fails, test_nixl_backend.py), or those asked where the
    source does not say (0)."""
    server, port = _serve(_ShortPin(granted))
    transfer = GrpcKvTransfer(PULL_TIMEOUT_S)
    transfer.bind(_Store(), lambda *_: None)
    try:
        before = time.monotonic()
        outcome = transfer.start_pin(_order(port).session, 5.0)
        held_until = outcome()
        after = time.monotonic()
    finally:
        transfer.close()
        server.stop(0)
    assert before + expected <= held_until <= after + expected
