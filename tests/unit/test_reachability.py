"""Why a server's channel never became ready (refengine/protocol/reachability.py), as the
conformance suite and bench report it: in gRPC's own words, not a bare timeout."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from refengine.bench import target
from refengine.client import OpenEngineClient
from refengine.conformance import Options, select
from refengine.conformance.runner import run_report
from refengine.conformance.target import ConnectError
from refengine.protocol.reachability import not_ready_reason
from tests.refused_ports import http1_address, refused_address


def _reason(address: str, timeout_s: float = 0.5) -> str:
    with grpc.insecure_channel(address) as channel:
        return not_ready_reason(channel, timeout_s)


def test_a_closed_port_says_connection_refused() -> None:
    with refused_address() as address:
        assert "Connection refused" in _reason(address)


def test_an_http1_server_on_the_port_is_named() -> None:
    with http1_address() as address:
        assert "http1" in _reason(address)


def test_a_host_that_does_not_resolve_is_named() -> None:
    assert "nonexistent.invalid" in _reason("nonexistent.invalid:50051")


@pytest.mark.parametrize("timeout_s", [5.0, 0.0], ids=["ready-in-time", "ready-only-to-the-probe"])
def test_a_grpc_server_is_ready(timeout_s: float) -> None:
    """With no wait at all the channel is not ready yet; the probe then connects, the server
    answers UNIMPLEMENTED (no service has the probe's method), and that is ready."""
    server = grpc.server(futures.ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert _reason(f"127.0.0.1:{port}", timeout_s) == ""
    finally:
        server.stop(0)


def test_conformance_and_bench_say_why() -> None:
    with refused_address() as address:
        with pytest.raises(ConnectError, match=f"cannot connect to {address} within 0.5 s: .*Connection refused"):
            run_report(address, select(["D1"]), Options(rpc_timeout_s=0.5))
        with OpenEngineClient(address) as client, pytest.raises(
                target.TargetError, match=f"{address}: not reachable within 0.5 s: .*Connection refused"):
            target.discover(client, connect_timeout=0.5)
    with http1_address() as address, pytest.raises(ConnectError, match="http1"):
        run_report(address, select(["D1"]), Options(rpc_timeout_s=0.5))
