"""Embedding handles on the wire (draft profile ``encoder``): ``refengine.v1alpha1.EmbeddingHandle``
↔ the engine's ``EmbeddingHandleSpec``, and the ``GenerateRequest.extra`` key that carries them.

Why ``extra`` (ENC10): ``openengine.v1`` must not change, and ``extra`` is its extension point
(G8: unknown keys are ignored, so a server without the profile ignores the key — and then
refuses the request's unfilled placeholders, never guesses). The key is versioned with the
draft package: ``refengine.v1alpha1.media_handles``, a list with one ``EmbeddingHandle`` per
media placeholder, in order, each in the proto3 JSON mapping (``json_format``: lowerCamelCase
or proto field names; uint64 as a decimal string). Unknown fields inside a handle are
ignored (forward-compatible within v1alpha1); anything else malformed is INVALID_ARGUMENT.
"""

from __future__ import annotations

from google.protobuf import json_format, struct_pb2

from refengine.protocol import oe
from refengine.protocol.v1alpha1 import media_pb2 as media
from refengine.server.errors import invalid
from refengine.types import EmbeddingHandleSpec, EmbeddingTransferSpec, KvEndpointSpec

EXTRA_MEDIA_HANDLES = "refengine.v1alpha1.media_handles"
MODALITY_NAMES = {oe.MODALITY_IMAGE: "image", oe.MODALITY_VIDEO: "video", oe.MODALITY_AUDIO: "audio"}
MODALITY_VALUES = {name: value for value, name in MODALITY_NAMES.items()}


def handle_to_pb(spec: EmbeddingHandleSpec, endpoints: tuple[KvEndpointSpec, ...]) -> media.EmbeddingHandle:
    """An encoder's handle, every transfer reachable at this server's ``endpoints``."""
    transfers = []
    for transfer in spec.transfers:
        attributes = struct_pb2.Struct()
        attributes.update(dict(transfer.attributes))
        transfers.append(media.EmbeddingTransfer(
            backend=transfer.backend, attributes=attributes,
            endpoints=[oe.KvEndpoint(host=e.host, port=e.port, protocol=e.protocol) for e in endpoints]))
    return media.EmbeddingHandle(
        handle_id=spec.handle_id, mm_hash=spec.mm_hash, mm_hash_algorithm=spec.mm_hash_algorithm,
        modality=MODALITY_VALUES.get(spec.modality, oe.MODALITY_UNSPECIFIED), shape=list(spec.shape),
        dtype=spec.dtype, num_tokens=spec.num_tokens, layout=spec.layout, fingerprint=spec.fingerprint,
        transfers=transfers, lease_expires_unix_nanos=spec.lease_expires_unix_nanos, cached=spec.cached)


def handle_from_pb(handle: media.EmbeddingHandle) -> EmbeddingHandleSpec:
    if handle.num_tokens != (handle.shape[0] if handle.shape else 0):
        raise invalid(f"media handle {handle.handle_id!r}: num_tokens {handle.num_tokens} is not shape[0]")
    return EmbeddingHandleSpec(
        handle_id=handle.handle_id, mm_hash=handle.mm_hash, mm_hash_algorithm=handle.mm_hash_algorithm,
        modality=MODALITY_NAMES.get(handle.modality, f"modality {handle.modality}"), shape=tuple(handle.shape),
        dtype=handle.dtype, layout=handle.layout, fingerprint=handle.fingerprint,
        transfers=tuple(EmbeddingTransferSpec(
            t.backend, tuple(KvEndpointSpec(e.host, e.port, e.protocol) for e in t.endpoints),
            json_format.MessageToDict(t.attributes)) for t in handle.transfers),
        lease_expires_unix_nanos=handle.lease_expires_unix_nanos, cached=handle.cached)


def handles_from_extra(extra: struct_pb2.Struct) -> tuple[EmbeddingHandleSpec, ...]:
    """G8 for the profile's key: absent = no handles; not a list of handle objects → INVALID_ARGUMENT."""
    if EXTRA_MEDIA_HANDLES not in extra.fields:
        return ()
    value = extra.fields[EXTRA_MEDIA_HANDLES]
    if value.WhichOneof("kind") != "list_value":
        raise invalid(f"extra[{EXTRA_MEDIA_HANDLES!r}] must be a list of EmbeddingHandle objects, "
                      f"got {value.WhichOneof('kind')}")
    handles = []
    for index, entry in enumerate(value.list_value.values):
        if entry.WhichOneof("kind") != "struct_value":
            raise invalid(f"extra[{EXTRA_MEDIA_HANDLES!r}][{index}] must be an EmbeddingHandle object")
        handle = media.EmbeddingHandle()
        try:
            json_format.ParseDict(json_format.MessageToDict(entry.struct_value), handle, ignore_unknown_fields=True)
        except (json_format.ParseError, ValueError) as exc:  # ValueError: a NaN or infinity, which JSON lacks
            raise invalid(f"extra[{EXTRA_MEDIA_HANDLES!r}][{index}] is not an EmbeddingHandle: {exc}") from None
        handles.append(handle_from_pb(handle))
    return tuple(handles)

