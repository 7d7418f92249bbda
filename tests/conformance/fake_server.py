"""A toy OpenEngine server for testing the conformance suite itself (no model, no torch).

The engine is tests/conformance/toy_engine.py: ASCII tokens, a deterministic "model",
the rules of the release (OpenEngine v0.1.0, BSR commit 768a93c7...) that the suite
checks, and ``Faults`` that break some of them on purpose
so that tests can show the suite catches the violation.
"""

from __future__ import annotations

from concurrent import futures
from typing import Any

import grpc
from google.protobuf import json_format

from refengine.protocol import oe
from tests.conformance.toy_engine import (
    BLOCK,
    CTX,
    GUIDED_BACKEND,
    GUIDED_MODES,
    INVALID,
    MAX_N,
    MAX_RUNNING,
    MAX_TOP_N,
    MODELS,
    Faults,
    Refused,
    ToyEngine,
    parse_metadata,
)

__all__ = ["Faults", "serve"]


class Inference(oe.InferenceServicer):
    def __init__(self, engine: ToyEngine) -> None:
        self.engine = engine

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        try:
            job = self.engine.submit(request, parse_metadata(context.invocation_metadata()))
        except Refused as err:
            context.abort(err.code, str(err))
        if not self.engine.faults.ignore_disconnect:
            context.add_callback(lambda: self.engine.abort(request.request_id))
        while True:
            ev = job.events.get()
            if ev is None:
                return
            yield ev


class Control(oe.ControlServicer):
    def __init__(self, engine: ToyEngine) -> None:
        self.engine = engine

    def GetServerInfo(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        return oe.ServerInfo(
            engine_name="toy", engine_version="0", engine_role=oe.ENGINE_ROLE_AGGREGATED, instance_id="toy-1",
            supported_models=["toy"], schema_revision=1, minimum_client_revision=1,
            schema_release=self.engine.faults.schema_release,
            parallelism=oe.ParallelismInfo(tensor_parallel_size=1, data_parallel_size=1, data_parallel_rank=0,
                                           decode_context_parallel_size=1),
            capacity=oe.DeploymentCapacity(kv_block_size=BLOCK, total_kv_blocks=4096,
                                           max_running_requests=MAX_RUNNING, max_batched_tokens=64))

    def GetModelInfo(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        if not request.model:
            context.abort(INVALID, "model is required")
        if request.model not in MODELS:
            context.abort(grpc.StatusCode.NOT_FOUND, "unknown model")
        modes = [oe.CANDIDATE_TOKEN_SELECTION_MODE_TOP_N, oe.CANDIDATE_TOKEN_SELECTION_MODE_TOKEN_IDS,
                 oe.CANDIDATE_TOKEN_SELECTION_MODE_ALL]
        lp = oe.LogprobCapabilities(supported=True, candidate_selection_modes=modes, max_top_n=MAX_TOP_N)
        info = oe.ModelInfo(
            model_id="toy", served_model_name="toy", served_model_aliases=["toy-alias"], max_context_length=CTX,
            supports_text_input=True, supports_token_ids_input=True, supports_lora=False, supports_multimodal=False,
            generation=oe.GenerationCapabilities(
                prompt_logprobs=lp, output_logprobs=lp, max_num_sequences=MAX_N, supports_priority=True,
                supports_stop_in_output=True, supports_cache_salt=True, supports_prefix_cache_bypass=True,
                guided_decoding=self.guided_caps()))
        extra: dict[str, Any] = {"generate_extra_keys": {"toy_knob": "number"}}
        if self.engine.faults.guided:
            extra["refengine.guided_backends"] = {GUIDED_BACKEND: list(GUIDED_MODES)}
        json_format.ParseDict(extra, info.extra)
        return info

    def guided_caps(self) -> Any:
        if not self.engine.faults.guided:
            return oe.GuidedDecodingCapabilities(supported=False)
        return oe.GuidedDecodingCapabilities(supported=True, modes=list(GUIDED_MODES.values()))

    def GetLoad(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        with self.engine.lock:
            running = self.engine.running_jobs()
            used = sum(-(-(len(j.prompt) + len(o.tokens)) // BLOCK) for j in running for o in j.outputs)
            info = oe.LoadInfo(instance_id="toy-1", running_requests=len(running),
                               queued_requests=len(self.engine.jobs) - len(running), used_kv_blocks=used,
                               total_kv_blocks=4096)
        if self.engine.faults.load_defaults:  # every unmeasured scalar "filled in" with 0
            for name in ("timestamp_unix_nanos", "active_kv_sessions", "total_kv_blocks", "running_tokens",
                         "waiting_tokens", "prefill_batch_size", "decode_batch_size"):
                setattr(info, name, 0)
        if request.include_per_rank:
            info.ranks.add(data_parallel_rank=0, running_requests=info.running_requests,
                           queued_requests=info.queued_requests, used_kv_blocks=used, total_kv_blocks=4096)
        return info

    def Health(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        resp = oe.HealthResponse(state=self.engine.faults.health_state)
        resp.checks.add(name="engine", state=oe.HEALTH_STATE_READY)
        if request.include_inference_probe:
            resp.checks.add(name="inference_probe", state=oe.HEALTH_STATE_READY)
        return resp

    def Abort(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        target = request.WhichOneof("target")
        if target is None:
            context.abort(INVALID, "no target")
        if target == "kv_session":
            context.abort(grpc.StatusCode.NOT_FOUND, "unknown session")
        if target == "all_requests":
            ids = list(self.engine.jobs)
            for rid in ids:
                self.engine.abort(rid)
            return oe.AbortResponse(status=oe.ABORT_STATUS_ABORTED if ids else oe.ABORT_STATUS_ALREADY_FINISHED)
        status = self.engine.abort(request.request_id)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "unknown request")
        return oe.AbortResponse(status=status)

    def LoadLora(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "LoRA disabled")

    def UnloadLora(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "LoRA disabled")

    def ListLoras(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "LoRA disabled")


def serve(faults: Faults | None = None) -> tuple[grpc.Server, str, ToyEngine]:
    """Start the toy server on a free loopback port; returns (server, address, engine)."""
    engine = ToyEngine(faults or Faults())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    oe.add_InferenceServicer_to_server(Inference(engine), server)
    oe.add_ControlServicer_to_server(Control(engine), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}", engine
