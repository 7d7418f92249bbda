"""``refengine.kvpull.v1.KvPull``: a prefill server hands its KV sessions to decode servers.

Served on the prefill server's port (the ``grpc`` transfer backend; ``nixl`` uses ``Pin``
and NIXL's own notification instead of ``Pull``/``Release``). Every read runs on a worker
thread while the session cannot be freed (``KvSessionStore.begin_read``); a chunk is whole
blocks, at most ``--kv-pull-chunk-kib`` and within ``--max-send-message-mib`` (at least one
block: a server whose one block exceeds its message limit does not start), with its CRC-32,
so memory stays bounded by one chunk per pull in flight. Unknown, released or expired session →
NOT_FOUND; a range outside the session (checked whole before any chunk), an empty one or another
KV layout → INVALID_ARGUMENT; a Pin of NaN or ≤ 0 seconds → INVALID_ARGUMENT (one longer than
``--kv-pull-timeout`` is capped). While the model loads: UNAVAILABLE, as the Control RPCs.

An encoder server (draft profile ``encoder``) serves its embedding handles the same way: a
handle is a session whose blocks are embedding rows, its layout the rows' (ENC9).
"""

from __future__ import annotations

import asyncio
import zlib

import grpc

from refengine.engine.interface import EngineClient
from refengine.kv.transfer.base import SESSION_CONTENT_KEY, content_digest, pinned_content
from refengine.protocol.kvpull.v1 import kv_pull_pb2 as pb
from refengine.protocol.kvpull.v1 import kv_pull_pb2_grpc as pb_grpc
from refengine.server.errors import Rejection, abort_call
from refengine.server.state import ServerState
from refengine.types import InvalidRequestError, KvSessionMismatch, KvSessionNotFound

#: Room in a chunk's message for its fields besides the data (two varints, a length, a CRC).
CHUNK_OVERHEAD_BYTES = 1024


def blocks_per_chunk(chunk_bytes: int, max_send_message_bytes: int, block_nbytes: int) -> int:
    """Whole blocks per chunk: within ``chunk_bytes`` and the server's message limit (a larger
    message fails the pull with RESOURCE_EXHAUSTED, every time), at least one.
    ``ValueError`` when a single block's message exceeds the limit."""
    room = max_send_message_bytes - CHUNK_OVERHEAD_BYTES
    if block_nbytes > room:
        raise ValueError(f"one KV block holds {block_nbytes} bytes, more than a {max_send_message_bytes >> 20} MiB "
                         "message (--max-send-message-mib) can carry to a puller: raise it or lower --block-size")
    return max(1, min(chunk_bytes, room) // block_nbytes)


class KvPullServicer(pb_grpc.KvPullServicer):
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def _engine(self, context: grpc.aio.ServicerContext) -> EngineClient:
        try:  # still loading (or failed to): UNAVAILABLE, as every Control RPC answers then
            engine = self.state.engine_for_control()
        except Rejection as rejection:
            await abort_call(context, rejection.code, rejection.message)
        if engine.info.role not in ("prefill", "encoder"):
            await abort_call(context, grpc.StatusCode.FAILED_PRECONDITION,
                             "this server holds no KV sessions (it is not a prefill or encoder server)")
        return engine

    async def Pull(self, request: pb.PullRequest, context: grpc.aio.ServicerContext):  # noqa: N802, ANN201
        engine = await self._engine(context)
        layout = engine.kv_layout()
        if request.kv_layout != layout:
            await abort_call(context, grpc.StatusCode.INVALID_ARGUMENT,
                                f"kv_layout {request.kv_layout!r} differs from this server's {layout!r}")
        try:  # the puller checks what the session holds (an embedding handle: its item, ENC8)
            content = engine.kv_session_content(request.session_id)
            size = engine.kv_session_blocks(request.session_id)
        except KvSessionNotFound as exc:
            await abort_call(context, grpc.StatusCode.NOT_FOUND, str(exc))
        # The whole range, before any chunk: a range past the end failed only at its first chunk
        # outside, after streaming the rest, and an empty one answered OK (found by review).
        if request.num_blocks < 1 or request.first_block_index + request.num_blocks > size:
            await abort_call(context, grpc.StatusCode.INVALID_ARGUMENT,
                             f"blocks [{request.first_block_index}, {request.first_block_index + request.num_blocks}) "
                             f"requested; session {request.session_id!r} holds {size} (num_blocks must be at least 1)")
        await context.send_initial_metadata(((SESSION_CONTENT_KEY, content_digest(content)),))
        per_chunk = blocks_per_chunk(self.state.engine_config.kv_transfer.chunk_bytes,
                                     self.state.options.max_send_message_bytes, engine.block_nbytes())
        end = request.first_block_index + request.num_blocks
        first = request.first_block_index
        while first < end:
            count = min(per_chunk, end - first)
            try:
                data = await asyncio.to_thread(engine.read_kv_session, request.session_id, first, count)
            except KvSessionNotFound as exc:
                await abort_call(context, grpc.StatusCode.NOT_FOUND, str(exc))
            except InvalidRequestError as exc:
                await abort_call(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            yield pb.KvChunk(first_block_index=first, num_blocks=count, data=data, crc32=zlib.crc32(data))
            first += count

    async def Release(self, request: pb.SessionRequest, context: grpc.aio.ServicerContext) -> pb.SessionReply:  # noqa: N802
        engine = await self._engine(context)
        if not engine.confirm_kv_session(request.session_id):
            await abort_call(context, grpc.StatusCode.NOT_FOUND, f"KV session {request.session_id!r} not found")
        return pb.SessionReply()

    async def Pin(self, request: pb.PinRequest, context: grpc.aio.ServicerContext) -> pb.SessionReply:  # noqa: N802
        engine = await self._engine(context)
        if not request.seconds > 0:  # NaN and 0 too: a pin of no time pins nothing, and NaN poisons the window
            await abort_call(context, grpc.StatusCode.INVALID_ARGUMENT, f"seconds must be > 0, got {request.seconds}")
        seconds = min(request.seconds, self.state.engine_config.kv_transfer.pull_timeout_seconds)
        try:
            content = engine.kv_session_content(request.session_id)
            block_ids = engine.pin_kv_session(request.session_id, seconds, request.expected_content)
            # What the puller's READ reads (ENC8, K10): the content, in the blocks and the memory it
            # names itself (from attributes a client forwards).
            digest = content_digest(pinned_content(content, block_ids, engine.kv_read_identity()))
            try:
                await context.send_initial_metadata(((SESSION_CONTENT_KEY, digest),))
            except asyncio.CancelledError:
                # The reader gave up on this call (cancelled, or past its deadline) before hearing of
                # the pin, so it will never end it: end it here rather than hold the blocks for the
                # whole window (found by review). A reply lost after this point is left to the window.
                engine.unpin_kv_session(request.session_id)
                raise
            return pb.SessionReply(num_blocks=len(block_ids), pinned_seconds=seconds)
        except KvSessionNotFound as exc:
            await abort_call(context, grpc.StatusCode.NOT_FOUND, str(exc))
        except KvSessionMismatch as exc:
            await abort_call(context, grpc.StatusCode.FAILED_PRECONDITION, str(exc))
