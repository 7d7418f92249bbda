"""The ``grpc`` KV transfer backend, decode side: pull a session from its prefill server.

``pull`` runs on one of the engine's transfer threads with a blocking gRPC channel (one
per prefill endpoint, reused): it streams the blocks, checks each chunk (order, size,
CRC-32) before writing it into the destination blocks, stops when ``cancelled`` is set (the
stream is cancelled, also while it waits for a chunk), and finally asks the prefill server
to ``Release`` the session (without waiting for the answer: the blocks are already here).
The bytes go straight into the engine's ``BlockStore``: this module never sees a tensor.

Failures (``TransferFailure``; ``retryable`` = the prefill server may still hold it):
NOT_FOUND → "not_found"; unreachable, or a server that cannot hold the session
(``NEVER_SERVED``) → "failed", not retryable (a restarted prefill server has lost its
sessions); a bad chunk, a timeout, a stream cut mid-way → "failed", retryable.
``start_pin`` serves the NIXL backend (``SessionPinner``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable

import grpc

from refengine.kv.transfer.base import (
    SESSION_CONTENT_KEY,
    BlockStore,
    Cancellation,
    KvTransferBackend,
    PullOrder,
    SessionConfirmed,
    TransferFailure,
    content_digest,
)
from refengine.protocol.kvpull.v1 import kv_pull_pb2 as pb
from refengine.protocol.kvpull.v1 import kv_pull_pb2_grpc as pb_grpc
from refengine.server.options import host_port
from refengine.types import KvSessionSpec

logger = logging.getLogger(__name__)
#: The endpoint protocols a KvPull service answers on (NIXL's pins and releases go over it too).
PULL_PROTOCOLS = ("grpc", "nixl")
#: Above the largest chunk a source sends (64 MiB, or one block where a block is larger).
MIN_RECEIVE_MESSAGE_BYTES = 80 << 20
#: Answers after which the same pull can never succeed (not retryable): a malformed pull; a server
#: that holds no sessions (still loading after a restart, which lost them all, or of another
#: role: FAILED_PRECONDITION); an endpoint without the KvPull service (UNIMPLEMENTED).
NEVER_SERVED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED)
#: Answers a KvPull source gives on purpose: their details are its own, passed on to the client.
SOURCE_ANSWERS = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
                  grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
#: Source endpoints whose channel is kept (least recently used dropped first). A session's
#: endpoint is named by the client, so an unbounded cache grew by one channel per name sent.
MAX_CACHED_SOURCES = 64


def _log_failed_release(session_id: str, call: grpc.Future) -> None:
    if not call.cancelled() and call.exception() is not None:
        logger.warning("KV session %s pulled, but its release failed: %s", session_id, call.exception())


class GrpcKvTransfer(KvTransferBackend):
    name = "grpc"
    protocol = "grpc"

    def __init__(self, pull_timeout_seconds: float) -> None:
        self.pull_timeout_seconds = pull_timeout_seconds
        self._store: BlockStore | None = None
        # target -> its channel and stub (building a stub costs ~0.1 ms), most recently used last
        self._sources: OrderedDict[str, tuple[grpc.Channel, pb_grpc.KvPullStub]] = OrderedDict()
        self._lock = threading.Lock()

    def bind(self, store: BlockStore, on_confirmed: SessionConfirmed) -> None:
        self._store = store  # prefill side: the KvPull service reads through the engine instead

    def _stub(self, session: KvSessionSpec) -> pb_grpc.KvPullStub:
        endpoint = next((e for e in session.endpoints if e.protocol in PULL_PROTOCOLS), None)
        if endpoint is None:
            raise TransferFailure("failed", f"session {session.session_id!r} names no grpc endpoint")
        target = host_port(endpoint.host, endpoint.port)
        with self._lock:
            if target in self._sources:
                self._sources.move_to_end(target)
                return self._sources[target][1]
            block_nbytes = self._store.block_nbytes if self._store is not None else 0
            largest = max(MIN_RECEIVE_MESSAGE_BYTES, block_nbytes + (1 << 20))
            channel = grpc.insecure_channel(target, options=(("grpc.max_receive_message_length", largest),))
            self._sources[target] = (channel, pb_grpc.KvPullStub(channel))
            if len(self._sources) > MAX_CACHED_SOURCES:
                # Dropped, not closed: a pull or pin still running on it holds it, and it is
                # freed once the last of them ends.
                self._sources.popitem(last=False)
            return self._sources[target][1]

    def pull(self, order: PullOrder, cancelled: Cancellation) -> None:
        assert self._store is not None, "bind first"
        stub = self._stub(order.session)
        request = pb.PullRequest(session_id=order.session.session_id, first_block_index=order.first_block_index,
                                 num_blocks=len(order.dest_block_ids), kv_layout=self._store.layout)
        deadline = time.monotonic() + self.pull_timeout_seconds
        call = stub.Pull(request, timeout=self.pull_timeout_seconds, metadata=order.trace)
        cancelled.on_cancel(call.cancel)  # wakes the read below, blocked on a source that may never answer
        try:
            if order.content:
                self._check_content(order, call)
            self._receive(order, call, cancelled)
        except grpc.RpcError as err:
            raise self._failure(err, order) from None
        finally:
            call.cancel()
        # Not waited for: the blocks are here, and a lost release only leaves the source's copy to its lease.
        release = stub.Release.future(pb.SessionRequest(session_id=order.session.session_id),
                                      timeout=max(1.0, deadline - time.monotonic()), metadata=order.trace)
        release.add_done_callback(functools.partial(_log_failed_release, order.session.session_id))

    @staticmethod
    def _check_content(order: PullOrder, call: grpc.Call | grpc.Future) -> None:
        """The source's session holds what the order names (``SESSION_CONTENT_KEY``): a handle
        whose mm_hash was changed, or whose endpoint names another source, would put rows of
        another item into the consumer's prefix cache under this item's identity."""
        said = dict(call.initial_metadata() or ()).get(SESSION_CONTENT_KEY)
        if said is None and not call.is_active() and call.code() != grpc.StatusCode.OK:
            return  # a refusal without headers (NOT_FOUND: the session is gone): its status says why
        if said != content_digest(order.content):
            raise TransferFailure("failed", f"session {order.session.session_id!r} does not hold "
                                  f"{order.content!r}: " + ("its source did not say what it holds" if said is None
                                                           else "the source holds another item"))

    def _receive(self, order: PullOrder, call: grpc.Call, cancelled: Cancellation) -> None:
        assert self._store is not None
        expected, written = order.first_block_index, 0
        for chunk in call:
            if cancelled.is_set():
                raise TransferFailure("failed", "cancelled")
            size = chunk.num_blocks * self._store.block_nbytes
            if chunk.first_block_index != expected or len(chunk.data) != size or chunk.num_blocks == 0 \
                    or written + chunk.num_blocks > len(order.dest_block_ids):
                raise TransferFailure("failed", f"chunk at block {chunk.first_block_index} is out of order or "
                                      "mis-sized", retryable=True)
            if zlib.crc32(chunk.data) != chunk.crc32:
                raise TransferFailure("failed", f"chunk at block {chunk.first_block_index} fails its checksum "
                                      "(corrupted in transit)", retryable=True)
            self._store.write(order.dest_block_ids[written:written + chunk.num_blocks], chunk.data)
            written += chunk.num_blocks
            expected += chunk.num_blocks
        if written != len(order.dest_block_ids):
            raise TransferFailure("failed", f"stream ended after {written} of {len(order.dest_block_ids)} blocks",
                                  retryable=True)

    @staticmethod
    def _failure(err: grpc.RpcError, order: PullOrder) -> TransferFailure:
        code, details = err.code(), err.details()
        if code not in SOURCE_ANSWERS:
            # A connection error or a peer that is no KvPull server: its details would tell the
            # client what listens at the address it named (a port scan); the log keeps them.
            logger.warning("pulling session %s from %s failed: %s: %s", order.session.session_id,
                           [f"{e.host}:{e.port}" for e in order.session.endpoints], code.name, details)
            details = "see the server's log"
        where = f"pulling session {order.session.session_id!r}: {code.name}: {details}"
        if code == grpc.StatusCode.NOT_FOUND:
            return TransferFailure("not_found", where)
        if code == grpc.StatusCode.UNAVAILABLE:
            return TransferFailure("failed", f"source server (prefill or encoder) unreachable, {where}",
                                   retryable=False)
        if code in NEVER_SERVED:
            return TransferFailure("failed", where, retryable=False)
        return TransferFailure("failed", where, retryable=True)

    def start_pin(self, session: KvSessionSpec, seconds: float, trace: tuple[tuple[str, str], ...] = (),
                  content: str = "", cancelled: Cancellation | None = None) -> Callable[[], float]:
        pin = pb.PinRequest(session_id=session.session_id, seconds=seconds,
                            expected_content=content_digest(content) if content else "")
        sent = time.monotonic()  # the source makes the pin later: its window ends after sent + its seconds
        call = self._stub(session).Pin.future(pin, timeout=self.pull_timeout_seconds, metadata=trace)
        if cancelled is not None:  # as for a pull: a cancelled request frees its thread now (found by review:
            cancelled.on_cancel(call.cancel)  # a NIXL pull waited its whole pin timeout on a hung source)
        order = PullOrder("", session, 0, (), content=content)

        def outcome() -> float:
            try:
                reply = call.result()
            except grpc.FutureCancelledError:
                raise TransferFailure("failed", f"pinning session {session.session_id!r}: cancelled") from None
            except grpc.RpcError as err:
                raise self._failure(err, order) from None
            if content:
                try:
                    self._check_content(order, call)
                except TransferFailure as failure:
                    failure.pin_held = True
                    raise
            return sent + (reply.pinned_seconds or seconds)  # 0: a source that does not say
        return outcome

    def close(self) -> None:
        with self._lock:
            channels = [channel for channel, _ in self._sources.values()]
            self._sources.clear()
        for channel in channels:
            channel.close()
