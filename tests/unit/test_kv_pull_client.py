"""The gRPC KV pull client (decode side, also the consumer of embedding handles) against a
KvPull server on loopback that misbehaves: a source that never sends a chunk must not hold a
transfer thread once the request is cancelled (ENC13, K8), and answers after which the same
pull can never succeed are not retryable."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from refengine.kv.transfer.base import SESSION_CONTENT_KEY, Cancellation, PullOrder, TransferFailure, content_digest
from refengine.protocol.kvpull.v1 import kv_pull_pb2_grpc as pb_grpc
from refengine.server.kv_pull_client import GrpcKvTransfer
from refengine.types import KvEndpointSpec, KvSessionSpec

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
