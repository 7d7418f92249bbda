"""``Control.Health`` and the standard grpc.health.v1 service (RULES H1–H3).

Checks, each with a state and a message:

- ``grpc``       READY whenever this RPC is answered;
- ``model``      STARTING while loading, READY once loaded, NOT_READY if loading failed;
- ``scheduler``  STARTING / READY / NOT_READY, following the server lifecycle; while the
  server drains it is NOT_READY with a message naming the drain (the release has no
  DRAINING state: H3);
- ``role``       only when the request names a ``role``: NOT_READY if it is not ours;
- ``inference_probe`` only when asked: a one-token greedy generation through the engine,
  bounded by ``--health-probe-timeout-seconds`` (H2), in the role's way: a prefill engine
  prefills it into a KV session, which the probe releases at once (also after a timeout); a
  decode engine, which takes sessions only from a prefill engine, computes the prompt itself
  (``GenerationRequest.health_probe``). Each probe uses its own request id, so concurrent
  probes are independent.

The overall ``state`` is the worst check (H1), in the order READY < DEGRADED < STARTING <
NOT_READY; no value outside the release's ``HealthState`` (above 4) is ever sent.
grpc.health.v1 reports SERVING exactly while the lifecycle is READY, for the empty service
name and for each OpenEngine service.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer as GrpcHealthServicer

from refengine.engine.interface import EngineClient
from refengine.protocol import oe
from refengine.server.state import Lifecycle, ServerState
from refengine.server.validation import check_model
from refengine.types import (
    EngineStoppedError,
    FinishReason,
    GenerationRequest,
    KvParams,
    RequestError,
    RequestOutput,
    SamplingParams,
    StoppingParams,
)

SEVERITY = [
    oe.HEALTH_STATE_READY,
    oe.HEALTH_STATE_DEGRADED,
    oe.HEALTH_STATE_STARTING,
    oe.HEALTH_STATE_NOT_READY,
]
LIFECYCLE_STATE = {
    Lifecycle.STARTING: oe.HEALTH_STATE_STARTING,
    Lifecycle.READY: oe.HEALTH_STATE_READY,
    Lifecycle.DRAINING: oe.HEALTH_STATE_NOT_READY,
    Lifecycle.NOT_READY: oe.HEALTH_STATE_NOT_READY,
}
SCHEDULER_MESSAGES = {
    Lifecycle.STARTING: "starting: the model is loading",
    Lifecycle.READY: "ready: accepting new requests",
    Lifecycle.DRAINING: "draining: shutting down, accepting no new requests; running streams finish "
                        "within the grace period",
    Lifecycle.NOT_READY: "not ready: the model failed to load",
}
ROLES = {
    "aggregated": oe.ENGINE_ROLE_AGGREGATED,
    "prefill": oe.ENGINE_ROLE_PREFILL,
    "decode": oe.ENGINE_ROLE_DECODE,
    # the release has no encoder role (draft profile "encoder", ENC2): none of its roles
    "encoder": oe.ENGINE_ROLE_UNSPECIFIED,
}


def overall(checks: list[oe.HealthCheck]) -> int:
    """H1: the worst check's state."""
    return max((c.state for c in checks), key=SEVERITY.index, default=oe.HEALTH_STATE_READY)


def _check(name: str, state: int, message: str) -> oe.HealthCheck:
    return oe.HealthCheck(name=name, state=state, message=message)


#: Above any openengine-priority (int32) a client can send: a probe waits for no queued request,
#: only for room, so a busy server that still serves answers READY (H3), not "no token in time".
PROBE_PRIORITY = 2**31


async def inference_probe(engine: EngineClient, timeout: float) -> oe.HealthCheck:
    """H2: generate one greedy token from a one-token prompt, ahead of every queued request;
    READY when it arrives in time."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[RequestOutput] = loop.create_future()

    def finished(out: RequestOutput) -> None:  # event loop
        if out.prefill is not None:  # nobody will pull the probe's session: free its blocks now
            engine.abort_kv_session(out.prefill.session_id)
        if not done.done():
            done.set_result(out)

    def sink(out: RequestOutput) -> None:  # engine thread
        if out.finished:
            loop.call_soon_threadsafe(finished, out)

    info = engine.info
    first = info.bos_token_id if info.bos_token_id is not None else (list(info.eos_token_ids) or [0])[0]
    request_id = f"refengine-health-probe-{uuid.uuid4().hex}"
    params = GenerationRequest(
        request_id=request_id,
        prompt_token_ids=[first],
        sampling=SamplingParams(temperature=0.0),
        stopping=StoppingParams(max_tokens=1, ignore_eos=True),
        kv=KvParams(bypass_prefix_cache=True),
        health_probe=True,
        priority=PROBE_PRIORITY,
    )
    started, steps_before = time.perf_counter(), engine.stats().num_steps
    try:
        engine.add_request(params, sink)
    except RequestError as exc:  # a stopped engine serves nothing: NOT_READY; else busy, or a limit
        state = oe.HEALTH_STATE_NOT_READY if isinstance(exc, EngineStoppedError) else oe.HEALTH_STATE_DEGRADED
        return _check("inference_probe", state, f"probe not admitted: {exc}")
    try:
        out = await asyncio.wait_for(asyncio.shield(done), timeout)
    except asyncio.CancelledError:  # the caller left (its deadline): the probe is nobody's work now
        engine.abort(request_id)
        raise
    except TimeoutError:
        engine.abort(request_id)
        stats = engine.stats()
        if stats.num_steps > steps_before:  # serving, and full: the probe waited for room (H3: not NOT_READY)
            return _check("inference_probe", oe.HEALTH_STATE_DEGRADED,
                          f"no token within {timeout:g} s: saturated ({stats.running_requests} requests running, "
                          f"{stats.waiting_requests} waiting, {stats.num_steps - steps_before} steps meanwhile)")
        return _check("inference_probe", oe.HEALTH_STATE_NOT_READY, f"no token within {timeout:g} s, and no step ran")
    elapsed_ms = (time.perf_counter() - started) * 1000
    if out.error is not None:
        return _check("inference_probe", oe.HEALTH_STATE_NOT_READY, f"probe failed: {out.error.message}")
    finishes = [d.finish for d in out.deltas if d.finish is not None]
    if finishes and finishes[-1].reason is FinishReason.CANCELLED:
        return _check("inference_probe", oe.HEALTH_STATE_DEGRADED, "probe was aborted")
    return _check("inference_probe", oe.HEALTH_STATE_READY, f"1 token in {elapsed_ms:.0f} ms")


async def health_response(state: ServerState, request: oe.HealthRequest) -> oe.HealthResponse:
    """Build the ``HealthResponse``; raises ``Rejection`` for an unknown probe model (D3)."""
    lifecycle = state.lifecycle
    checks = [_check("grpc", oe.HEALTH_STATE_READY, "serving")]
    if state.engine_error is not None:
        checks.append(_check("model", oe.HEALTH_STATE_NOT_READY, state.engine_error))
    elif state.engine is not None:
        checks.append(_check("model", oe.HEALTH_STATE_READY, f"{state.engine.info.served_model_name} loaded"))
    elif lifecycle is Lifecycle.NOT_READY:
        checks.append(_check("model", oe.HEALTH_STATE_NOT_READY, f"load failed: {state.load_error}"))
    else:
        checks.append(_check("model", oe.HEALTH_STATE_STARTING, f"loading {state.engine_config.model}"))
    checks.append(_check("scheduler", LIFECYCLE_STATE[lifecycle], _lifecycle_message(state)))
    ours = ROLES[state.options.role]
    # An enum value this build does not know reads as UNSPECIFIED (X4), never as a mismatch.
    known_roles = set(oe.EngineRole.values())
    if request.role in known_roles and request.role not in (oe.ENGINE_ROLE_UNSPECIFIED, ours):
        checks.append(_check("role", oe.HEALTH_STATE_NOT_READY,
                             f"this server's role is {state.options.role}, not the one asked for"))
    if request.include_inference_probe:
        if request.model and state.caps is not None:
            check_model(request.model, state.caps)
        checks.append(await _probe_check(state))
    return oe.HealthResponse(state=overall(checks), checks=checks)


def _lifecycle_message(state: ServerState) -> str:
    if state.engine_error is not None:  # NOT_READY with an engine: it stopped after a fault
        return f"not ready: {state.engine_error}"
    return SCHEDULER_MESSAGES[state.lifecycle]


async def _probe_check(state: ServerState) -> oe.HealthCheck:
    if state.lifecycle is not Lifecycle.READY or state.engine is None:
        return _check("inference_probe", LIFECYCLE_STATE[state.lifecycle], f"not run: {_lifecycle_message(state)}")
    if state.engine.info.role == "encoder":
        return await encode_probe(state.engine, state.options.health_probe_timeout_seconds)
    return await inference_probe(state.engine, state.options.health_probe_timeout_seconds)


async def encode_probe(engine: EngineClient, timeout: float) -> oe.HealthCheck:
    """An encoder's probe (ENC2): one small image through the vision path, no handle made."""
    started = time.perf_counter()
    try:
        encoded = await asyncio.wait_for(asyncio.to_thread(engine.probe), timeout)  # type: ignore[attr-defined]
    except TimeoutError:
        return _check("inference_probe", oe.HEALTH_STATE_NOT_READY, f"no image encoded within {timeout:g} s")
    except Exception as exc:  # noqa: BLE001 - any failure of the vision path is the probe's finding
        return _check("inference_probe", oe.HEALTH_STATE_NOT_READY, f"probe failed: {type(exc).__name__}: {exc}")
    if not encoded:  # H3: busy is serving; waiting would also hold a worker thread KvPull reads need
        return _check("inference_probe", oe.HEALTH_STATE_DEGRADED, "not run: busy, an encode is in progress")
    return _check("inference_probe", oe.HEALTH_STATE_READY,
                  f"1 image encoded in {(time.perf_counter() - started) * 1000:.0f} ms")


class GrpcHealth:
    """grpc.health.v1: SERVING exactly while READY, for "" and each OpenEngine service of the
    listener asked (register listeners before the first ``follow``). A service another listener
    serves is unknown here (NOT_FOUND), as the protocol says: with ``--control-port`` both
    listeners answered SERVING for Control and Inference alike."""

    def __init__(self) -> None:
        self._listeners: list[tuple[GrpcHealthServicer, tuple[str, ...]]] = []

    async def follow(self, lifecycle: Lifecycle) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if lifecycle is Lifecycle.READY
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for servicer, names in self._listeners:
            for name in names:
                await servicer.set(name, status)

    def register(self, server: grpc.aio.Server, service_names: tuple[str, ...]) -> None:
        """``server``'s own health service, for the OpenEngine ``service_names`` it serves."""
        servicer = GrpcHealthServicer()
        self._listeners.append((servicer, ("", *service_names)))
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
