"""Registering the OpenEngine servicers with tolerant request parsing.

The generated ``add_*Servicer_to_server`` parse requests inside gRPC: bytes that are not a
valid message (invalid UTF-8 in a string, truncated, garbage) then end the RPC with status
UNKNOWN before our code runs. Here each method is registered with a parser that never
raises; a request that does not parse reaches the servicer as :class:`Malformed` and is
refused with INVALID_ARGUMENT and a message naming the message type (X1: before
acceptance, no events). Method names, types and streaming kinds come from the service
descriptors, so the wire shape stays exactly the generated one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from refengine.protocol import oe
from refengine.protocol.openengine.v1 import openengine_pb2
from refengine.server.errors import abort_call


@dataclass(frozen=True)
class Malformed:
    """A request whose bytes did not parse as its message type."""

    message: str


def _parser(message_class: type) -> Callable[[bytes], object]:
    def parse(data: bytes) -> object:
        try:
            return message_class.FromString(data)
        except DecodeError as exc:
            return Malformed(f"the request is not a valid {message_class.DESCRIPTOR.full_name}: {exc}")

    return parse


def _guarded(behavior: Callable) -> Callable:
    async def handler(request: object, context: grpc.aio.ServicerContext) -> object:
        if isinstance(request, Malformed):
            await abort_call(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await behavior(request, context)

    return handler


def add_servicer(servicer: object, service_name: str, server: grpc.aio.Server) -> None:
    """Register every method of ``openengine.v1.<service_name>`` implemented by ``servicer``
    (coroutine methods; streaming ones write with ``context.write``)."""
    service = openengine_pb2.DESCRIPTOR.services_by_name[service_name]
    handlers = {}
    for method in service.methods:
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            _guarded(getattr(servicer, method.name)),
            request_deserializer=_parser(getattr(oe, method.input_type.name)),
            response_serializer=getattr(oe, method.output_type.name).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
