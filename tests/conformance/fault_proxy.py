"""A gRPC proxy that breaks one rule of a real server: the negative controls of checks that need
a real model (the draft encoder profile: tests/integration/test_encoder_negative_controls.py).

The proxy serves every method of ``openengine.v1`` and ``refengine.v1alpha1.Media`` on a loopback
port and forwards each call to the upstream server unchanged (request, metadata, deadline, status,
client cancel), except the methods a ``Fault`` overrides. An override gets the request, the
call's context and ``forward`` (which sends a request upstream and returns its answer: a message,
or an iterator of them for a server stream, raising ``grpc.RpcError`` as the upstream does), and
answers in its place. What a client sees is then a server that breaks the rule the fault names,
and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import message_factory

from refengine.protocol.openengine.v1 import openengine_pb2
from refengine.protocol.v1alpha1 import media_pb2

#: An override: (request, context, forward) -> the answer (a message; an iterator for a server stream).
Override = Callable[[Any, grpc.ServicerContext, Callable[[Any], Any]], Any]
#: Metadata gRPC sets itself: not forwarded.
RESERVED = ("user-agent", "grpc-")


@dataclass(frozen=True)
class Fault:
    """The methods ("Service/Method", e.g. "Media/Encode") a broken server answers differently."""

    overrides: dict[str, Override] = field(default_factory=dict)


def _methods() -> dict[str, Any]:
    """Every proxied method's descriptor, by its full path "/package.Service/Method"."""
    found = {}
    for file in (openengine_pb2.DESCRIPTOR, media_pb2.DESCRIPTOR):
        for service in file.services_by_name.values():
            for method in service.methods:
                found[f"/{service.full_name}/{method.name}"] = method
    return found


class _Handler(grpc.GenericRpcHandler):
    def __init__(self, upstream: grpc.Channel, fault: Fault) -> None:
        self.upstream, self.fault, self.methods = upstream, fault, _methods()

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = self.methods.get(details.method)
        if method is None or method.client_streaming:
            return None  # no proxied method streams requests (UNIMPLEMENTED, as upstream would say)
        request_type = message_factory.GetMessageClass(method.input_type)
        response_type = message_factory.GetMessageClass(method.output_type)
        short = f"{method.containing_service.name}/{method.name}"
        override = self.fault.overrides.get(short)
        stream = method.server_streaming
        make = self.upstream.unary_stream if stream else self.upstream.unary_unary
        call = make(details.method, request_serializer=request_type.SerializeToString,
                    response_deserializer=response_type.FromString)

        def answer(request: Any, context: grpc.ServicerContext) -> Any:
            def forward(message: Any) -> Any:
                metadata = [(k, v) for k, v in context.invocation_metadata() if not k.startswith(RESERVED)]
                remaining = context.time_remaining()  # the client's deadline (None or huge: none)
                timeout = remaining if remaining is not None and remaining < 1e6 else None
                upstream = call(message, metadata=metadata, timeout=timeout)
                if stream:
                    context.add_callback(upstream.cancel)  # a client cancel reaches the upstream server
                return upstream

            try:
                if override is not None:
                    result = override(request, context, forward)
                else:
                    result = forward(request)
                if stream:
                    yield from result
                else:
                    yield result
            except grpc.RpcError as err:
                context.abort(err.code(), err.details() or "")

        if stream:
            return grpc.unary_stream_rpc_method_handler(answer, request_type.FromString,
                                                        response_type.SerializeToString)
        return grpc.unary_unary_rpc_method_handler(lambda r, c: next(answer(r, c)), request_type.FromString,
                                                   response_type.SerializeToString)


class FaultProxy:
    """``fault`` in front of the server at ``upstream``; ``address`` is where clients connect."""

    def __init__(self, upstream: str, fault: Fault) -> None:
        self.channel = grpc.insecure_channel(upstream)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        self.server.add_generic_rpc_handlers((_Handler(self.channel, fault),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def close(self) -> None:
        self.server.stop(0)
        self.channel.close()


def each(stream: Iterator[Any], change: Callable[[Any], None]) -> Iterator[Any]:
    """``stream`` with ``change`` applied to every message (in place)."""
    for message in stream:
        change(message)
        yield message
