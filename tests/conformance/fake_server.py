"""A toy OpenEngine server for testing the conformance suite itself (no model, no torch).

The engine is tests/conformance/toy_engine.py: ASCII tokens, a deterministic "model",
the rules of the release (OpenEngine v0.1.0, BSR commit 768a93c7...) that the suite
checks, and ``Faults`` that break each of them on purpose so that tests can show the suite
catches the violation. ``serve(faults)`` starts one on loopback; tests/conformance/toy_kv_events.py
adds KV events, tests/conformance/toy_roles.py a PREFILL/DECODE pair.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from typing import Any

import grpc
from google.protobuf import json_format

from refengine.protocol import oe
from tests.conformance.toy_engine import ToyEngine
from tests.conformance.toy_faults import Faults
from tests.conformance.toy_requests import (
    BLOCK,
    CTX,
    GUIDED_BACKEND,
    GUIDED_MODES,
    INVALID,
    MAX_N,
    MAX_RUNNING,
    MAX_TOP_N,
    MODELS,
    Refused,
    parse_metadata,
    priority,
)

__all__ = ["Control", "Faults", "Inference", "serve"]
TOTAL_BLOCKS = 4096
TRACE_KEYS = ("traceparent", "tracestate")
#: KvConnectorInfo's fields 8 and 9 of the pre-release wire (4def7c5): supports_drain = true,
#: schema_version = 1 (a release client reads the first as schema_version, the second not at all).
PRE_RELEASE_CONNECTOR_TAIL = bytes([8 << 3, 1, 9 << 3, 1])


class Inference(oe.InferenceServicer):
    def __init__(self, engine: ToyEngine) -> None:
        self.engine = engine

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        faults = self.engine.faults
        try:
            meta = parse_metadata(context.invocation_metadata(), faults)
            if faults.header_rank_over_session and "openengine-target-dp-rank" in meta:
                request.kv.ClearField("session")  # M3's fault: the header routes, the session is dropped
            job = self.engine.submit(request, priority(meta, faults))
        except Refused as err:
            context.abort(err.code, str(err))
        if not faults.ignore_disconnect:
            context.add_callback(lambda: self.engine.client_gone(request.request_id))
        while True:
            ev = job.events.get()
            if ev is None:
                return
            yield ev


class Control(oe.ControlServicer):
    role = oe.ENGINE_ROLE_AGGREGATED

    def __init__(self, engine: ToyEngine) -> None:
        self.engine = engine
        self.info_calls = 0  # GetServerInfo calls so far (the connector_changes fault)
        self.probes = 0  # inference probes running now (the probe_unsafe_concurrently fault)
        self.probes_lock = threading.Lock()

    def GetServerInfo(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        f = self.engine.faults
        info = oe.ServerInfo(
            engine_name="toy", engine_version="0", engine_role=self.role, instance_id="toy-1",
            supported_models=["toy"], schema_revision=1, minimum_client_revision=1, schema_release=f.schema_release,
            parallelism=oe.ParallelismInfo(tensor_parallel_size=1, data_parallel_size=1, data_parallel_rank=0,
                                           decode_context_parallel_size=0 if f.dcp_zero else 1),
            capacity=oe.DeploymentCapacity(kv_block_size=BLOCK, total_kv_blocks=TOTAL_BLOCKS,
                                           max_running_requests=MAX_RUNNING, max_batched_tokens=64))
        if f.role_unspecified and self.role == oe.ENGINE_ROLE_AGGREGATED:  # D7's fault (the target only)
            info.engine_role = oe.ENGINE_ROLE_UNSPECIFIED
        if f.zero_pipeline_size:
            info.parallelism.pipeline_parallel_size = 0
        if f.block_size_unreported:
            info.capacity.ClearField("kv_block_size")
        if f.capacity_shrinks:  # D6's fault: the free blocks reported as capacity
            info.capacity.total_kv_blocks = TOTAL_BLOCKS - len(self.engine.cache.blocks)
        if f.lora:
            info.capacity.max_loras = self.engine.loras.max_loras
        info.kv_connector.CopyFrom(self.connector())
        if f.connector_changes:  # K11's fault: a connector field that is not static
            self.info_calls += 1
            info.kv_connector.supports_abort_cleanup = self.info_calls % 2 == 0
        if f.connector_pre_release:
            info.kv_connector.MergeFromString(PRE_RELEASE_CONNECTOR_TAIL)
        return info

    def connector(self) -> Any:
        """K11: an AGGREGATED engine has no KV connector (toy_roles.py: the PREFILL/DECODE pair's)."""
        return oe.KvConnectorInfo(enabled=False)

    def GetModelInfo(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        f = self.engine.faults
        if not request.model:
            context.abort(INVALID, "model is required")
        if request.model not in MODELS:
            context.abort(INVALID if f.model_info_unknown_invalid else grpc.StatusCode.NOT_FOUND, "unknown model")
        modes = [oe.CANDIDATE_TOKEN_SELECTION_MODE_TOP_N, oe.CANDIDATE_TOKEN_SELECTION_MODE_TOKEN_IDS,
                 oe.CANDIDATE_TOKEN_SELECTION_MODE_ALL]
        lp = oe.LogprobCapabilities(supported=True, candidate_selection_modes=modes, max_top_n=MAX_TOP_N)
        info = oe.ModelInfo(
            model_id="" if f.empty_model_id else "toy", served_model_name="toy", served_model_aliases=["toy-alias"],
            max_context_length=CTX, supports_text_input=True, supports_token_ids_input=True, supports_lora=f.lora,
            supports_multimodal=f.multimodal or f.images,
            generation=oe.GenerationCapabilities(
                prompt_logprobs=oe.LogprobCapabilities(supported=False) if f.prompt_logprobs_unadvertised else lp,
                output_logprobs=lp, max_num_sequences=MAX_N, supports_priority=True,
                supports_stop_in_output=True, supports_cache_salt=True, supports_prefix_cache_bypass=True,
                guided_decoding=self.guided_caps()))
        extra: dict[str, Any] = {"generate_extra_keys": {"toy_knob": "number"}}
        if f.guided:
            extra["refengine.guided_backends"] = {GUIDED_BACKEND: list(GUIDED_MODES)}
        json_format.ParseDict(extra, info.extra)
        return info

    def guided_caps(self) -> Any:
        if not self.engine.faults.guided:
            return oe.GuidedDecodingCapabilities(supported=False)
        return oe.GuidedDecodingCapabilities(supported=True, modes=list(GUIDED_MODES.values()))

    def GetLoad(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        f = self.engine.faults
        if f.refuse_trace_on_load and any(k in TRACE_KEYS for k, _ in context.invocation_metadata()):
            context.abort(INVALID, "unexpected metadata")
        with self.engine.lock:
            running = self.engine.running_jobs()
            info = oe.LoadInfo(instance_id="toy-1", running_requests=len(running),
                               queued_requests=len(self.engine.jobs) - len(running),
                               used_kv_blocks=self.engine.used_blocks(), total_kv_blocks=TOTAL_BLOCKS)
        if f.load_defaults:  # every unmeasured scalar "filled in" with 0
            for name in ("timestamp_unix_nanos", "active_kv_sessions", "total_kv_blocks", "running_tokens",
                         "waiting_tokens", "prefill_batch_size", "decode_batch_size"):
                setattr(info, name, 0)
        if request.include_per_rank and not f.no_rank_rows:
            admitted = self.engine.admitted if f.rank_rows_count_admitted else info.running_requests
            info.ranks.add(data_parallel_rank=0, running_requests=admitted,
                           queued_requests=info.queued_requests, used_kv_blocks=info.used_kv_blocks,
                           total_kv_blocks=TOTAL_BLOCKS)
        return info

    def Health(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        f = self.engine.faults
        if f.reject_unknown_role and request.role not in oe.EngineRole.values():
            context.abort(INVALID, f"unknown role {request.role}")
        state = f.health_state
        if f.starting_unprobed and not request.include_inference_probe:
            state = oe.HEALTH_STATE_STARTING
        resp = oe.HealthResponse(state=state)
        resp.checks.add(name="engine", state=oe.HEALTH_STATE_READY if state == f.health_state else state)
        if f.health_check_degraded:
            resp.checks.add(name="kv_cache", state=oe.HEALTH_STATE_DEGRADED)
        if request.include_inference_probe:
            resp.checks.add(name="inference_probe", state=self._probe(f.probe_unsafe_concurrently))
            if resp.checks[-1].state == oe.HEALTH_STATE_NOT_READY:
                resp.state = oe.HEALTH_STATE_NOT_READY
        return resp

    def _probe(self, unsafe: bool) -> int:
        """One probe's state; an unsafe one fails while another probe runs."""
        with self.probes_lock:
            self.probes += 1
            overlapping = self.probes > 1
        if unsafe:
            time.sleep(0.05)  # long enough for concurrent probes to overlap
        with self.probes_lock:
            overlapping = overlapping or self.probes > 1
            self.probes -= 1
        return oe.HEALTH_STATE_NOT_READY if unsafe and overlapping else oe.HEALTH_STATE_READY

    def Abort(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        f = self.engine.faults
        target = request.WhichOneof("target")
        if target is None:
            context.abort(grpc.StatusCode.NOT_FOUND if f.abort_no_target_not_found else INVALID, "no target")
        if target == "kv_session":
            return self.abort_session(request.kv_session, context)
        if target == "all_requests":
            ids = [j.req.request_id for j in self.engine.running_jobs()] if f.abort_all_skips_queued \
                else list(self.engine.jobs)
            for rid in ids:
                self.engine.abort(rid)
            if ids and f.abort_all_leaks:
                self.engine.leaked_blocks += 2
            aborted = ids and not f.abort_all_wrong_status
            return oe.AbortResponse(status=oe.ABORT_STATUS_ABORTED if aborted else oe.ABORT_STATUS_ALREADY_FINISHED)
        status = self.engine.abort(request.request_id)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "unknown request")
        return oe.AbortResponse(status=status)

    def abort_session(self, session: Any, context: grpc.ServicerContext) -> Any:
        """An AGGREGATED engine holds no session (a PREFILL one does: toy_roles.py)."""
        context.abort(grpc.StatusCode.NOT_FOUND, "unknown session")

    def LoadLora(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        return self._lora(lambda: self.engine.loras.load(request), context)

    def UnloadLora(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        return self._lora(lambda: self.engine.loras.unload(request), context)

    def ListLoras(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        return self._lora(self.engine.loras.listed, context)

    @staticmethod
    def _lora(call: Any, context: grpc.ServicerContext) -> Any:
        try:
            return call()
        except Refused as err:
            context.abort(err.code, str(err))


def start(engine: ToyEngine, inference: Any, control: Any) -> tuple[grpc.Server, str]:
    """Serve ``inference`` and ``control`` on a free loopback port; returns (server, address)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    oe.add_InferenceServicer_to_server(inference, server)
    oe.add_ControlServicer_to_server(control, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def serve(faults: Faults | None = None) -> tuple[grpc.Server, str, ToyEngine]:
    """Start the toy server on a free loopback port; returns (server, address, engine)."""
    engine = ToyEngine(faults or Faults())
    server, address = start(engine, Inference(engine), Control(engine))
    return server, address, engine
