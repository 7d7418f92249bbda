"""A client of the OpenEngine release built from its wire shape alone.

``tests/data/openengine-v0.1.0-wire.json`` is the fact sheet of the release v0.1.0 (tag
b5f2bd9, BSR commit 768a93c7…): every message's fields (name, number, type, label,
oneof, proto3 ``optional``), every enum value and every RPC. :class:`ReleaseClient` turns
it into descriptors with ``descriptor_pb2`` — never looking at this project's ``.proto``
files or generated bindings — and calls a server with raw bytes, so what it decodes is
exactly what a client generated from the published release would read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, struct_pb2
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

WIRE_JSON = Path(__file__).resolve().parent / "data" / "openengine-v0.1.0-wire.json"
PACKAGE = "openengine.v1"

_F = descriptor_pb2.FieldDescriptorProto
_SCALAR_TYPES = {
    "double": _F.TYPE_DOUBLE, "float": _F.TYPE_FLOAT, "int64": _F.TYPE_INT64, "uint64": _F.TYPE_UINT64,
    "int32": _F.TYPE_INT32, "uint32": _F.TYPE_UINT32, "bool": _F.TYPE_BOOL, "string": _F.TYPE_STRING,
    "bytes": _F.TYPE_BYTES, "sint32": _F.TYPE_SINT32, "sint64": _F.TYPE_SINT64, "fixed32": _F.TYPE_FIXED32,
    "fixed64": _F.TYPE_FIXED64, "sfixed32": _F.TYPE_SFIXED32, "sfixed64": _F.TYPE_SFIXED64,
    "message": _F.TYPE_MESSAGE, "enum": _F.TYPE_ENUM,
}


def _short(full_name: str) -> str:
    assert full_name.startswith(PACKAGE + "."), full_name
    return full_name[len(PACKAGE) + 1 :]


def _message(full_name: str, fields: list[dict[str, Any]]) -> descriptor_pb2.DescriptorProto:
    msg = descriptor_pb2.DescriptorProto(name=_short(full_name))
    oneofs: list[str] = []
    for spec in fields:
        field = msg.field.add(name=spec["name"], number=spec["number"], type=_SCALAR_TYPES[spec["type"]])
        field.label = _F.LABEL_REPEATED if spec["repeated"] else _F.LABEL_OPTIONAL
        if spec["type_name"]:
            field.type_name = "." + spec["type_name"]
        oneof = spec["oneof"]
        if spec["optional"]:
            oneof = "_" + spec["name"]  # proto3 optional: a synthetic oneof of one field
            field.proto3_optional = True
        if oneof is not None:
            if oneof not in oneofs:
                oneofs.append(oneof)
            field.oneof_index = oneofs.index(oneof)
    # Synthetic oneofs must come after the real ones.
    real = [o for o in oneofs if not o.startswith("_")]
    order = real + [o for o in oneofs if o.startswith("_")]
    for field in msg.field:
        if field.HasField("oneof_index"):
            field.oneof_index = order.index(oneofs[field.oneof_index])
    for name in order:
        msg.oneof_decl.add(name=name)
    return msg


def wire_file() -> descriptor_pb2.FileDescriptorProto:
    """One ``.proto`` file holding the whole release, as the wire JSON describes it."""
    shape = json.loads(WIRE_JSON.read_text(encoding="utf-8"))
    assert shape["package"] == PACKAGE
    file = descriptor_pb2.FileDescriptorProto(name="release_wire.proto", package=PACKAGE, syntax="proto3",
                                              dependency=["google/protobuf/struct.proto"])
    for full_name, values in sorted(shape["enums"].items()):
        enum = file.enum_type.add(name=_short(full_name))
        for value_name, number in sorted(values.items(), key=lambda kv: kv[1]):
            enum.value.add(name=value_name, number=number)
    for full_name, fields in sorted(shape["messages"].items()):
        file.message_type.append(_message(full_name, fields))
    for full_name, methods in sorted(shape["services"].items()):
        service = file.service.add(name=_short(full_name))
        for method_name, m in sorted(methods.items()):
            service.method.add(name=method_name, input_type="." + m["input"], output_type="." + m["output"],
                               client_streaming=m["client_streaming"], server_streaming=m["server_streaming"])
    return file


class ReleaseClient:
    """Calls ``openengine.v1`` RPCs with message classes built from the wire JSON."""

    def __init__(self, address: str) -> None:
        self.pool = descriptor_pool.DescriptorPool()
        struct_file = descriptor_pb2.FileDescriptorProto()
        struct_pb2.DESCRIPTOR.CopyToProto(struct_file)
        self.pool.Add(struct_file)
        self.pool.Add(wire_file())
        self.channel = grpc.insecure_channel(address)

    def __enter__(self) -> ReleaseClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.channel.close()

    def message(self, name: str, **fields: Any) -> Message:
        cls = message_factory.GetMessageClass(self.pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))
        msg = cls()
        for key, value in fields.items():
            if isinstance(value, dict):
                getattr(msg, key).MergeFrom(self.message(self._field_type(name, key), **value))
            elif isinstance(value, list):
                getattr(msg, key).extend(value)
            else:
                setattr(msg, key, value)
        return msg

    def _field_type(self, message: str, field: str) -> str:
        descriptor = self.pool.FindMessageTypeByName(f"{PACKAGE}.{message}").fields_by_name[field]
        return _short(descriptor.message_type.full_name)

    def _method(self, service: str, name: str) -> tuple[str, type[Message]]:
        method = self.pool.FindServiceByName(f"{PACKAGE}.{service}").methods_by_name[name]
        return f"/{PACKAGE}.{service}/{name}", message_factory.GetMessageClass(method.output_type)

    def unary(self, service: str, name: str, request: Message, timeout: float = 30) -> Message:
        path, reply_cls = self._method(service, name)
        call = self.channel.unary_unary(path, request_serializer=None, response_deserializer=None)
        return reply_cls.FromString(call(request.SerializeToString(), timeout=timeout))

    def stream(self, service: str, name: str, request: Message, timeout: float = 120) -> Iterator[Message]:
        path, reply_cls = self._method(service, name)
        call = self.channel.unary_stream(path, request_serializer=None, response_deserializer=None)
        for raw in call(request.SerializeToString(), timeout=timeout):
            yield reply_cls.FromString(raw)

    def enum_name(self, enum: str, number: int) -> str | None:
        """The release's name of ``number`` in ``enum``; None for a value the release lacks."""
        value = self.pool.FindEnumTypeByName(f"{PACKAGE}.{enum}").values_by_number.get(number)
        return None if value is None else value.name


def unknown_field_paths(msg: Message, path: str = "") -> list[str]:
    """Every place in ``msg`` holding fields the release does not know (e.g. a field
    number the server sends that the release gives to nothing)."""
    found = [f"{path or msg.DESCRIPTOR.name}#{f.field_number}" for f in UnknownFieldSet(msg)]
    for descriptor, value in msg.ListFields():
        if descriptor.message_type is None or descriptor.message_type.full_name.startswith("google.protobuf."):
            continue  # scalars; well-known types (Struct) are not part of the release's shape
        children = value if descriptor.is_repeated else [value]
        for i, child in enumerate(children):
            found += unknown_field_paths(child, f"{path}.{descriptor.name}[{i}]")
    return found
