"""``refengine.v1alpha1.Media`` (draft profile ``encoder``): served by an encoder server only.

Encode and Release run the engine's work on a worker thread (encoding is compute); RenewLease,
a lease update, runs on the event loop. Failures are a
non-OK status only: a bad item or lease → INVALID_ARGUMENT with the reason (the same checks as
``GenerateRequest.media``), no room → RESOURCE_EXHAUSTED, an unknown model → NOT_FOUND, a
gone handle on RenewLease → NOT_FOUND, a server that is not an encoder → UNIMPLEMENTED, still
loading → UNAVAILABLE. Rules ENC2–ENC7 in docs/profiles/encoder.md.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

import grpc

from refengine.protocol.v1alpha1 import media_pb2 as media
from refengine.protocol.v1alpha1 import media_pb2_grpc as media_grpc
from refengine.server.convert import media_input
from refengine.server.errors import Rejection, invalid
from refengine.server.media_wire import handle_to_pb
from refengine.server.state import ServerState
from refengine.server.unary import run_unary
from refengine.server.validation import check_model
from refengine.server.workers import SlowWork
from refengine.types import EmbeddingHandleSpec, MediaInput

#: An Encode done with less of its deadline left than this releases its handles and answers
#: DEADLINE_EXCEEDED: grpc.aio does not cancel a handler the moment its deadline passes, so one
#: that finished just after it returned normally, the reply was dropped, and no client learned the
#: handle ids (found by review: up to 24 handles held for their whole lease after 40 such calls).
#: A reply lost in flight later than this still leaves its handles to their lease.
REPLY_MARGIN_SECONDS = 0.05


class MediaServicer(media_grpc.MediaServicer):
    def __init__(self, state: ServerState) -> None:
        self.state = state

    def _encoder(self, new_work: bool = False):  # noqa: ANN202 - the EncoderEngine, seen through its methods
        """``new_work``: refused while draining (Encode); releases and renewals still run then."""
        engine = self.state.engine_for_generate() if new_work else self.state.engine_for_control()
        if engine.info.role != "encoder":
            raise Rejection(grpc.StatusCode.UNIMPLEMENTED, "this server is not an encoder (--role encoder); "
                            "it does not serve refengine.v1alpha1.Media")
        return engine

    async def _run(self, context: grpc.aio.ServicerContext, build):  # noqa: ANN001, ANN202
        return await run_unary(context, build, "Media")

    async def Encode(self, request: media.EncodeRequest, context: grpc.aio.ServicerContext):  # noqa: N802, ANN201
        async def build() -> media.EncodeResponse:
            engine = self._encoder(new_work=True)
            if request.model:
                check_model(request.model, self.state.caps)
            lease = request.lease_seconds if request.HasField("lease_seconds") else None
            items = [media_input(item) for item in request.items]
            handles = await _encode_owned(self.state.slow_work, engine, items, lease, request.cache_salt)
            left = context.time_remaining() if context is not None else None
            if left is not None and left < REPLY_MARGIN_SECONDS:  # the reply would come too late: dropped
                await asyncio.to_thread(engine.release_handles, [handle.handle_id for handle in handles])
                raise Rejection(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed while encoding; the "
                                "handles made were released")
            return media.EncodeResponse(handles=[handle_to_pb(h, self.state.kv_endpoints) for h in handles])

        with self.state.held_for_drain():
            return await self._run(context, build)

    async def Release(self, request: media.ReleaseRequest, context: grpc.aio.ServicerContext):  # noqa: N802, ANN201
        async def build() -> media.ReleaseResponse:
            engine = self._encoder()
            return media.ReleaseResponse(released=await asyncio.to_thread(engine.release_handles,
                                                                          list(request.handle_ids)))

        return await self._run(context, build)

    async def RenewLease(self, request: media.RenewLeaseRequest, context: grpc.aio.ServicerContext):  # noqa: N802, ANN201
        async def build() -> media.RenewLeaseResponse:
            engine = self._encoder()
            if not math.isfinite(request.lease_seconds) or request.lease_seconds <= 0:
                raise invalid(f"lease_seconds must be a positive finite number, got {request.lease_seconds}")
            expires = engine.renew_handle(request.handle_id, request.lease_seconds)
            return media.RenewLeaseResponse(lease_expires_unix_nanos=expires)

        return await self._run(context, build)


async def _encode_owned(slow_work: SlowWork, engine, items: Sequence[MediaInput],  # noqa: ANN001 - the EncoderEngine
                        lease: float | None, cache_salt: str) -> list[EmbeddingHandleSpec]:
    """``engine.encode`` on a slow-work thread (``workers.py``). When the RPC ends first (the client cancelled, its
    deadline passed), the thread still finishes and makes handles whose ids no client will ever
    learn, so nothing but their leases would free them: they are released as soon as it is done
    (and by ``Encode`` when it ends too close to the deadline: ``REPLY_MARGIN_SECONDS``)."""
    work = slow_work.run(engine.encode, items, lease, cache_salt)
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        work.add_done_callback(lambda done: _release_orphans(engine, done))
        raise


def _release_orphans(engine, work: asyncio.Future) -> None:  # noqa: ANN001 - the EncoderEngine
    if work.cancelled() or work.exception() is not None:  # nothing held (ENC3: all or nothing)
        return
    orphans = [handle.handle_id for handle in work.result()]
    asyncio.get_running_loop().run_in_executor(None, engine.release_handles, orphans)
