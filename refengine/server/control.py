"""``Control``: discovery (D1–D7), load (H4), health (H1–H3, in ``health.py``), abort
(A1–A3), the LoRA lifecycle (R1–R5) and KV-event discovery.

Unary RPCs report failures with a non-OK status only (X2). While the model loads, every
RPC but ``Health`` answers UNAVAILABLE (retry when Health is READY).

Choices where the contract is silent (ref):
- ``DeploymentCapacity.max_running_requests`` is the scheduler's ``max_num_seqs`` (each
  of a request's outputs counts), ``max_loras`` the adapter slots (0 with LoRA disabled);
- ``ServerInfo.kv_connector`` (K11): disabled on an aggregated server; on a prefill or decode
  server, its transfer backend (a prefill server's offered one; a decode server's first),
  this server's endpoint (a prefill server's sessions are pulled from its port) and every
  backend's protocol, ``schema_version`` 3 (``refengine.kv-session/3``);
- LoRA: the engine applies R1–R5 (``lora/registry.py``); loading reads files, so it runs
  off the event loop. A drain's grace period waits for a load or unload under way (X3).
  LoRA disabled → FAILED_PRECONDITION for all three RPCs, ``ListLoras`` included (R5).
  ``LoadLora`` without ``adapter`` → INVALID_ARGUMENT (R1);
- ``GetKvEventSources`` / ``SubscribeKvEvents``: ``kv_events_service.py``;
- ``Abort(kv_session)`` frees a held session (ABORTED); an unknown, released or expired one →
  NOT_FOUND (A2, K7): a session is not a request, so it has no ALREADY_FINISHED window.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict

import grpc
from google.protobuf import struct_pb2

import refengine
from refengine.engine.interface import EngineClient, EngineInfo
from refengine.protocol import oe
from refengine.server import kv_events_service
from refengine.server.capabilities import (
    GUIDED_BACKENDS_KEY,
    GUIDED_DEFAULT_BACKEND_KEY,
    guided_backends,
    model_info,
)
from refengine.server.convert import GENERATE_EXTRA_KEYS
from refengine.server.errors import Rejection, invalid
from refengine.server.health import ROLES, health_response
from refengine.server.profiles import PROFILES_KEY, profiles_of
from refengine.server.state import ServerState
from refengine.server.stream_bridge import ABORT_CONFIRM_SECONDS
from refengine.server.unary import run_unary
from refengine.server.validation import check_model
from refengine.types import EngineStats, LoraAdapterSpec, LoraDisabledError

SCHEMA_REVISION = 1
MINIMUM_CLIENT_REVISION = 1
#: D1: the immutable Buf registry commit of the release v0.1.0 (Git tag v0.1.0 = b5f2bd9), never a tag.
SCHEMA_RELEASE = "768a93c7b44e40f28c692ad0b471a8f2"


def _adapter(spec: LoraAdapterSpec) -> oe.LoraAdapter:
    return oe.LoraAdapter(lora_id=spec.lora_id, lora_name=spec.lora_name, source_path=spec.source_path)


def media_attributes(stats: EngineStats) -> dict[str, int]:
    """An encoder's handles and embedding rows (ENC15), as ``refengine.v1alpha1.*`` load attributes."""
    if stats.media is None:
        return {}
    return {f"refengine.v1alpha1.{name}": value for name, value in asdict(stats.media).items()}


def _struct(values: dict) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(values)
    return s


class ControlServicer(oe.ControlServicer):
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def _run(self, context: grpc.aio.ServicerContext, build):  # noqa: ANN001, ANN202
        return await run_unary(context, build, "Control")

    # -- discovery -------------------------------------------------------------
    def server_info(self) -> oe.ServerInfo:
        info = self.state.engine_for_control().info
        return oe.ServerInfo(
            engine_name="refengine",
            engine_version=refengine.__version__,
            engine_role=ROLES[self.state.options.role],
            instance_id=self.state.instance_id,
            # D3/D8: the primary name; aliases are listed in ModelInfo.served_model_aliases.
            supported_models=[self.state.caps.served_model_name],
            parallelism=oe.ParallelismInfo(
                tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1,
                data_parallel_rank=0, data_parallel_start_rank=0, decode_context_parallel_size=1,
            ),
            kv_connector=self.kv_connector(info),
            schema_revision=SCHEMA_REVISION,
            minimum_client_revision=MINIMUM_CLIENT_REVISION,
            schema_release=SCHEMA_RELEASE,
            capacity=oe.DeploymentCapacity(
                kv_block_size=info.kv_block_size,
                total_kv_blocks=info.total_kv_blocks,
                max_running_requests=info.max_num_seqs,
                max_batched_tokens=info.max_num_batched_tokens,
                max_loras=info.max_loras,
            ),
            extra=_struct({"device": info.device, "dtype": info.dtype, PROFILES_KEY: profiles_of(info),
                           **({"kv_cache_dtype": info.kv_cache_dtype} if info.kv_cache_dtype else {}),
                           **({"attention_backend": info.attention_backend,
                               "attention_backend_reason": info.attention_backend_reason} if info.attention_backend
                              else {}),
                           **({"cpu_bf16_path": info.cpu_bf16_path} if info.cpu_bf16_path else {})}),
        )

    def kv_connector(self, info: EngineInfo) -> oe.KvConnectorInfo:
        if info.role in ("aggregated", "encoder"):  # an encoder's handles are its draft profile's (ENC2)
            return oe.KvConnectorInfo(enabled=False)
        prefill = info.role == "prefill"
        return oe.KvConnectorInfo(
            enabled=True, transfer_backend=info.kv_transfer_backends[0],
            local_endpoints=[oe.KvEndpoint(host=e.host, port=e.port, protocol=e.protocol)
                             for e in self.state.kv_endpoints] if prefill else [],
            supported_protocols=list(info.kv_transfer_backends),
            supports_remote_prefill=prefill, supports_decode_pull=not prefill, supports_abort_cleanup=True,
            schema_version=3)

    async def GetServerInfo(self, request, context):  # noqa: ANN001, ANN201, N802
        async def build() -> oe.ServerInfo:
            return self.server_info()

        return await self._run(context, build)

    async def GetModelInfo(self, request, context):  # noqa: ANN001, ANN201, N802
        async def build() -> oe.ModelInfo:
            engine = self.state.engine_for_control()
            if not request.model:
                raise invalid("model is required; use one of ServerInfo.supported_models")  # D3 (ref)
            check_model(request.model, self.state.caps)
            # Publishing the known ``extra`` keys lets a portable suite check G8 unconfigured.
            return model_info(self.state.caps, {"vocab_size": engine.info.vocab_size,
                                                "generate_extra_keys": GENERATE_EXTRA_KEYS,
                                                GUIDED_BACKENDS_KEY: guided_backends(self.state.caps),
                                                GUIDED_DEFAULT_BACKEND_KEY: self.state.caps.guided_backends[0][0]})

        return await self._run(context, build)

    # -- load --------------------------------------------------------------------
    async def GetLoad(self, request, context):  # noqa: ANN001, ANN201, N802
        async def build() -> oe.LoadInfo:
            stats = self.state.engine_for_control().stats()
            load = oe.LoadInfo(
                instance_id=self.state.instance_id,
                timestamp_unix_nanos=time.time_ns(),
                running_requests=stats.running_requests,
                queued_requests=stats.waiting_requests,
                active_kv_sessions=stats.active_kv_sessions,
                used_kv_blocks=stats.used_kv_blocks,
                total_kv_blocks=stats.total_kv_blocks,
                running_tokens=stats.running_tokens,
                waiting_tokens=stats.waiting_tokens,
                prefill_batch_size=stats.prefill_batch_size,
                decode_batch_size=stats.decode_batch_size,
                attributes=_struct({"cached_kv_blocks": stats.cached_kv_blocks,
                                    "open_streams": len(self.state.streams),
                                    "kv_event_subscribers": stats.kv_event_subscribers,
                                    "kv_pulled_bytes": stats.kv_pulled_bytes,
                                    "kv_pull_seconds": stats.kv_pull_seconds,
                                    "embedding_pulled_bytes": stats.embedding_pulled_bytes,
                                    "embedding_pull_seconds": stats.embedding_pull_seconds,
                                    **media_attributes(stats)}),
            )
            if request.include_per_rank:
                load.ranks.append(oe.RankLoadInfo(
                    data_parallel_rank=0,
                    running_requests=stats.running_requests,
                    queued_requests=stats.waiting_requests,
                    used_kv_blocks=stats.used_kv_blocks,
                    total_kv_blocks=stats.total_kv_blocks,
                    prefill_batch_size=stats.prefill_batch_size,
                    decode_batch_size=stats.decode_batch_size,
                ))
            return load

        return await self._run(context, build)

    # -- health ------------------------------------------------------------------
    async def Health(self, request, context):  # noqa: ANN001, ANN201, N802
        return await self._run(context, lambda: health_response(self.state, request))

    # -- abort -------------------------------------------------------------------
    async def Abort(self, request, context):  # noqa: ANN001, ANN201, N802
        async def build() -> oe.AbortResponse:
            target = request.WhichOneof("target")
            if target is None:
                raise invalid("set exactly one abort target: request_id, kv_session or all_requests {}")  # A1
            engine = self.state.engine_for_control()
            if target == "kv_session":  # A2, K7
                session_id = request.kv_session.session_id
                if not session_id:
                    raise invalid("kv_session.session_id must be non-empty")
                if not engine.abort_kv_session(session_id):
                    raise Rejection(grpc.StatusCode.NOT_FOUND,
                                    f"KV session {session_id!r} not found: never made here, released or expired")
                return oe.AbortResponse(status=oe.ABORT_STATUS_ABORTED, message="KV session released")
            if target == "all_requests":  # A3
                aborted = engine.abort_all()
                waiting = self.state.flag_reusing(None)  # calls waiting to reuse an id abort once accepted
                if not aborted and not waiting:
                    return oe.AbortResponse(status=oe.ABORT_STATUS_ALREADY_FINISHED,
                                            message="nothing was running")
                waits = " and the requests waiting to reuse an id" if waiting else ""
                return oe.AbortResponse(status=oe.ABORT_STATUS_ABORTED,
                                        message=f"aborted {len(aborted)} requests{waits}")
            if not request.request_id:
                raise invalid("request_id must be non-empty")
            # A new request waits to reuse the id: it is the target (its namesake was aborted as it retired).
            if self.state.flag_reusing(request.request_id):
                return oe.AbortResponse(status=oe.ABORT_STATUS_ABORTED, message="aborted")
            if engine.abort(request.request_id) and await _cancelled_by(engine, request.request_id):  # A2
                return oe.AbortResponse(status=oe.ABORT_STATUS_ABORTED, message="aborted")
            if engine.was_finished(request.request_id):
                return oe.AbortResponse(status=oe.ABORT_STATUS_ALREADY_FINISHED, message="already finished")
            raise Rejection(grpc.StatusCode.NOT_FOUND, f"no request {request.request_id!r} is known")

        return await self._run(context, build)

    # -- LoRA lifecycle ------------------------------------------------------------
    async def LoadLora(self, request, context):  # noqa: ANN001, ANN201, N802
        async def build() -> oe.LoadLoraResponse:
            engine = self.state.engine_for_control()
            if not engine.info.max_loras:  # R5 whatever the request holds, as the engine says it
                raise LoraDisabledError("LoRA is disabled on this server (start it with --enable-lora)")
            if not request.HasField("adapter"):
                raise invalid("adapter is required (lora_id, lora_name, source_path)")
            a = request.adapter
            spec, already = await asyncio.to_thread(
                engine.load_lora, LoraAdapterSpec(a.lora_id, a.lora_name, a.source_path))
            return oe.LoadLoraResponse(adapter=_adapter(spec), already_loaded=already)

        with self.state.held_for_drain():  # its reply, not the listeners' cancel, ends it
            return await self._run(context, build)

    async def UnloadLora(self, request, context):  # noqa: ANN001, ANN201, N802
        async def build() -> oe.UnloadLoraResponse:
            engine = self.state.engine_for_control()
            # A worker thread: the unload waits for a load in progress (one at a time), which may
            # be reading an adapter's files; the event loop must keep serving meanwhile.
            adapter = await asyncio.to_thread(engine.unload_lora, request.lora_name)
            return oe.UnloadLoraResponse(adapter=_adapter(adapter))

        with self.state.held_for_drain():
            return await self._run(context, build)

    async def ListLoras(self, request, context):  # noqa: ANN001, ANN201, N802
        async def build() -> oe.ListLorasResponse:
            return oe.ListLorasResponse(adapters=[_adapter(s) for s in self.state.engine_for_control().list_loras()])

        return await self._run(context, build)

    async def GetKvEventSources(self, request, context):  # noqa: ANN001, ANN201, N802
        async def build() -> oe.GetKvEventSourcesResponse:
            return kv_events_service.kv_event_sources(self.state, request)

        return await self._run(context, build)

    async def SubscribeKvEvents(self, request, context):  # noqa: ANN001, ANN201, N802
        await kv_events_service.subscribe(self.state, request, context)


async def _cancelled_by(engine: EngineClient, request_id: str) -> bool:
    """After an accepted abort: whether it ended the request (A4), rather than the request's own
    stop in the step already running (its last token): then the answer is ALREADY_FINISHED, not
    ABORTED. Waits for the engine's final output, at most ABORT_CONFIRM_SECONDS (then ABORTED:
    the abort stands, and the stream will end CANCELLED); a request refused while being accepted
    has none: False at once (the caller answers NOT_FOUND)."""
    deadline = time.monotonic() + ABORT_CONFIRM_SECONDS
    while (ended := engine.ended_by_abort(request_id)) is None and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    return ended is not False
