"""``OpenEngineClient.wait_until_ready`` (found by review; each failed before its fix): it sends
the client's metadata like every other call (a proxy may need it to route or authorize), and a
hanging server does not stretch it past its timeout (each Health call gets what is left).
A server listing no models gets a clear ``ValueError`` where a model is defaulted (IndexError before)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from refengine.client import OpenEngineClient, stream_text
from refengine.protocol import oe


class Control(oe.ControlServicer):
    def __init__(self, hang: float) -> None:
        self.hang = threading.Event()
        self.hang_seconds = hang
        self.seen: list[dict[str, str]] = []
        self.models: list[str] = []

    def Health(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        self.seen.append(dict(context.invocation_metadata()))
        self.hang.wait(self.hang_seconds)
        return oe.HealthResponse(state=oe.HEALTH_STATE_READY)

    def GetServerInfo(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        return oe.ServerInfo(supported_models=self.models)


@pytest.fixture
def serve() -> Iterator[Any]:
    servers: list[tuple[grpc.Server, Control]] = []

    def start(hang: float = 0.0) -> tuple[Control, str]:
        control = Control(hang)
        server = grpc.server(futures.ThreadPoolExecutor(4))
        oe.add_ControlServicer_to_server(control, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append((server, control))
        return control, f"127.0.0.1:{port}"

    yield start
    for server, control in servers:
        control.hang.set()
        server.stop(0)


def test_wait_until_ready_sends_the_clients_metadata(serve: Any) -> None:
    control, address = serve()
    with OpenEngineClient(address, metadata=[("authorization", "Bearer t")]) as client:
        client.wait_until_ready(timeout=5)
    assert control.seen and control.seen[0].get("authorization") == "Bearer t"


def test_wait_until_ready_keeps_to_its_timeout_when_the_server_hangs(serve: Any) -> None:
    """Each call took min(5 s, timeout): at 5.5 s, the second call ran to 10 s."""
    _, address = serve(hang=30.0)
    with OpenEngineClient(address) as client:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="not READY after 5.5 s"):
            client.wait_until_ready(timeout=5.5)
        assert time.monotonic() - start < 6.5


def test_a_server_listing_no_models_is_a_clear_error_where_a_model_is_defaulted(serve: Any) -> None:
    control, address = serve()
    with OpenEngineClient(address) as client:
        with pytest.raises(ValueError, match="lists no supported_models"):
            client.model_info()
        with pytest.raises(ValueError, match="lists no supported_models"):
            next(stream_text(address, "hi", chat=lambda model, prompt: prompt))
        control.models = ["tiny", "other"]
        assert client.default_model() == "tiny"


def test_generate_refuses_a_request_with_fields_it_would_ignore() -> None:
    """A full request and a field (found by review): the field was silently dropped, e.g. a
    ``max_tokens=5`` that left the request unbounded."""
    with OpenEngineClient("127.0.0.1:1") as client:
        with pytest.raises(TypeError, match="max_tokens"):
            next(client.generate(oe.GenerateRequest(prompt="hi"), max_tokens=5))
