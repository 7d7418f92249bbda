"""Lifecycle on a server of its own (RULES H3, X1, X3): STARTING before the model is
loaded, Control on a separate listener, and a SIGTERM drain under load: Health NOT_READY
naming the drain, new requests refused, running streams finish within the grace period or
end with one terminal ``EngineError(CANCELLED, retryable)`` naming the drain, KV all freed,
then exit 0.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from refengine.client import OpenEngineClient
from refengine.conformance.kv_subscriber import KvSubscriber
from refengine.protocol import oe
from tests.integration.conftest import (
    ServerProcess,
    Stream,
    check_stream,
    collect,
    greedy_request,
    start_server,
    wait_ready,
)
from tests.release_client import ReleaseClient

GRACE = 4.0


@dataclass
class Starting:
    """What the server answered before its model was loaded."""

    health: int
    grpc_health: int
    generate_code: grpc.StatusCode
    server_info_code: grpc.StatusCode


def _grpc_health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


def _observe_starting(server: ServerProcess) -> Starting:
    with OpenEngineClient(server.control_address, timeout=5) as control, \
            OpenEngineClient(server.address, timeout=5) as inference:
        deadline = time.monotonic() + 60
        while True:
            try:
                health = control.health().state
                break
            except grpc.RpcError:
                if time.monotonic() > deadline or server.proc.poll() is not None:
                    raise RuntimeError(f"no Health answer:\n{server.log_tail()}") from None
                time.sleep(0.05)
        generate = collect(inference, greedy_request("early", "Hi", max_tokens=1), timeout=5)
        assert not generate.events
        try:
            control.server_info()
            info_code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            info_code = exc.code()
        return Starting(health, _grpc_health(server.control_address), generate.code, info_code)


@pytest.fixture(scope="module")
def own_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Starting]]:
    log = tmp_path_factory.mktemp("refengine-shutdown") / "server.log"
    server = start_server(log, "--max-model-len", "2048", "--num-kv-blocks", "128",
                          "--shutdown-grace-seconds", str(GRACE), control_port=True, wait_ready=False)
    try:
        starting = _observe_starting(server)
        wait_ready(server)
        yield server, starting
    finally:
        server.stop()


def test_starting_before_the_model_is_loaded(own_server: tuple[ServerProcess, Starting]) -> None:
    server, starting = own_server
    assert starting.health == oe.HEALTH_STATE_STARTING  # H3
    assert starting.grpc_health == health_pb2.HealthCheckResponse.NOT_SERVING
    assert starting.generate_code == grpc.StatusCode.UNAVAILABLE
    assert starting.server_info_code == grpc.StatusCode.UNAVAILABLE
    assert server.startup_states[-1] == "HEALTH_STATE_READY"


def test_control_on_its_own_listener(own_server: tuple[ServerProcess, Starting]) -> None:
    server, _ = own_server
    assert server.control_address != server.address
    with OpenEngineClient(server.address) as inference, OpenEngineClient(server.control_address) as control:
        assert control.server_info().engine_name == "refengine"
        with pytest.raises(grpc.RpcError) as info:
            inference.server_info()
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        refused = collect(control, greedy_request("wrong-port", "Hi", max_tokens=1))
        assert refused.code == grpc.StatusCode.UNIMPLEMENTED
        request = greedy_request("right-port", "Hi", max_tokens=2)
        check_stream(collect(inference, request), request)
        assert _grpc_health(server.address) == health_pb2.HealthCheckResponse.SERVING
    # Each listener lists and reports only its own services (both said SERVING for both before).
    for address, own, other in ((server.address, "openengine.v1.Inference", "openengine.v1.Control"),
                                (server.control_address, "openengine.v1.Control", "openengine.v1.Inference")):
        assert _grpc_health(address, own) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as unknown:
            _grpc_health(address, other)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        with grpc.insecure_channel(address) as channel:
            services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert own in services and other not in services, (address, services)


def _consume(client: OpenEngineClient, request: oe.GenerateRequest, into: Stream, started: threading.Event) -> None:
    try:
        for event in client.generate(request, timeout=120):
            into.events.append(event)
            started.set()
    except grpc.RpcError as exc:
        into.code, into.details = exc.code(), exc.details()
    started.set()


def _scheduler_check(control: OpenEngineClient) -> oe.HealthCheck:
    (check,) = [c for c in control.health().checks if c.name == "scheduler"]
    return check


def _drained(stream: Stream) -> bool:
    """Whether the stream was cut off by the drain: its one error event is the retryable
    CANCELLED the release uses for it (X3), with a message naming the drain."""
    errors = stream.of("error")
    if not errors:
        return False
    assert len(errors) == 1 and stream.events[-1].WhichOneof("event") == "error", stream.events[-3:]
    error = errors[0]
    assert error.code == oe.ERROR_CODE_CANCELLED and error.retryable, error  # X3
    assert "drain" in error.message, error.message
    return True


def test_sigterm_drains_under_load_then_exits_zero(own_server: tuple[ServerProcess, Starting]) -> None:
    """H3, X1, X3: a drain with 2 short and 4 long streams running. New requests are
    refused with UNAVAILABLE and no events; Health is NOT_READY (never a value above 4) with
    a scheduler check naming the drain; short streams finish, long ones end with the one
    retryable CANCELLED error; every KV block is free or cached at exit; exit code 0."""
    server, _ = own_server
    requests = [greedy_request(f"short-{i}", f"Count: one, two, {i}", max_tokens=4) for i in range(2)]
    requests += [greedy_request(f"long-{i}", f"Write a very long story number {i}.", max_tokens=1500,
                                ignore_eos=True) for i in range(4)]
    streams = {r.request_id: Stream() for r in requests}
    with OpenEngineClient(server.address) as inference, OpenEngineClient(server.control_address) as control:
        subscription = KvSubscriber(control.control, oe.SubscribeKvEventsRequest(), timeout=60)
        threads = []
        for request in requests:
            started = threading.Event()
            thread = threading.Thread(target=_consume, args=(inference, request, streams[request.request_id], started))
            thread.start()
            assert started.wait(60), "no first event"
            threads.append(thread)
        server.signal(signal.SIGTERM)
        signalled = time.monotonic()
        states = []  # as a client built from the release's wire shape names them
        with ReleaseClient(server.control_address) as release:
            while time.monotonic() - signalled < GRACE - 0.5:
                health = release.unary("Control", "Health", release.message("HealthRequest"))
                states.append(release.enum_name("HealthState", health.state))
                if states[-1] != "HEALTH_STATE_READY":
                    break
                time.sleep(0.05)
        assert states[-1] == "HEALTH_STATE_NOT_READY", states  # H3: no DRAINING state in the release
        assert "drain" in _scheduler_check(control).message
        assert _grpc_health(server.control_address) == health_pb2.HealthCheckResponse.NOT_SERVING
        refused = collect(inference, greedy_request("late", "Hi", max_tokens=1), timeout=5)
        assert refused.code == grpc.StatusCode.UNAVAILABLE and not refused.events  # X1 (ref: UNAVAILABLE)
        assert "drain" in refused.details
        for thread in threads:
            thread.join(GRACE + 10)
        # X3/E5: a live KV event subscription ends too, with one retryable error, then OK
        assert subscription.wait_end(GRACE + 10), subscription.describe()
        code = server.proc.wait(GRACE + 10)
        elapsed = time.monotonic() - signalled
    assert code == 0, server.log_tail()
    assert elapsed < GRACE + 5, f"exit took {elapsed:.1f} s"
    assert None not in states, states  # every state a value the release knows
    for request in requests:
        stream = streams[request.request_id]
        drained = _drained(stream)
        check_stream(stream, request, success=not drained)
        if request.request_id.startswith("short"):
            assert not drained, f"{request.request_id} should finish within the grace period"
        else:
            assert drained, f"{request.request_id} (1500 tokens) cannot finish within {GRACE} s"
    assert subscription.code == grpc.StatusCode.OK and subscription.batches, subscription.describe()
    assert subscription.kinds()[-1] == "error" and subscription.kinds().count("error") == 1, subscription.describe()
    last = subscription.errors[-1]
    assert last.code == oe.ERROR_CODE_CANCELLED and last.retryable and "drain" in last.message, last
    log = server.log_tail(20000)
    assert "Traceback" not in log, log
    used = re.search(r"KV pool at exit: (\d+) used", log)
    assert used is not None and used.group(1) == "0", log[-2000:]
