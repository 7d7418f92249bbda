"""ENC10: embedding handles in ``GenerateRequest.extra`` (``server/media_wire.py``)."""

from __future__ import annotations

import pytest
from google.protobuf import json_format, struct_pb2

from refengine.protocol.v1alpha1 import media_pb2 as media
from refengine.server.errors import Rejection
from refengine.server.media_wire import EXTRA_MEDIA_HANDLES, handle_from_pb, handle_to_pb, handles_from_extra
from refengine.types import EmbeddingHandleSpec, EmbeddingTransferSpec, KvEndpointSpec

SPEC = EmbeddingHandleSpec(
    handle_id="h1", mm_hash="ab" * 32, mm_hash_algorithm="refengine-rgb8-sha256", modality="image", shape=(16, 64),
    dtype="float32", layout="refengine-embeddings/1:row-major:64:float32", fingerprint="f" * 64,
    transfers=(EmbeddingTransferSpec("nixl", (), {"nixl_block_ids": [0, 1]}), EmbeddingTransferSpec("grpc")),
    lease_expires_unix_nanos=2**62 + 1, cached=True)
ENDPOINTS = (KvEndpointSpec("encoder.local", 7000, "grpc"),)


def extra_of(value: object) -> struct_pb2.Struct:
    extra = struct_pb2.Struct()
    extra.update({EXTRA_MEDIA_HANDLES: value})
    return extra


def test_round_trip_in_both_json_spellings() -> None:
    wire = handle_to_pb(SPEC, ENDPOINTS)
    assert [t.endpoints[0].host for t in wire.transfers] == ["encoder.local"] * 2
    expected = handle_from_pb(wire)
    assert expected.identity == "sha256:" + "ab" * 32 and expected.lease_expires_unix_nanos == 2**62 + 1
    for spelling in (json_format.MessageToDict(wire),
                     json_format.MessageToDict(wire, preserving_proto_field_name=True)):
        spelling["a_future_field"] = 1  # unknown fields inside a handle are ignored
        assert handles_from_extra(extra_of([spelling])) == (expected,)
    assert handles_from_extra(struct_pb2.Struct()) == ()


@pytest.mark.parametrize("value", ["a handle", {"handleId": "x"}, [1], [{"shape": "wide"}],
                                   [{"shape": [16, 64], "numTokens": 3}],
                                   [{"shape": [float("nan")]}], [{"future": float("inf")}]])  # not JSON: was INTERNAL
def test_malformed_values_are_invalid_argument(value: object) -> None:
    with pytest.raises(Rejection) as refused:
        handles_from_extra(extra_of(value))
    assert refused.value.code.name == "INVALID_ARGUMENT"
    assert EXTRA_MEDIA_HANDLES in refused.value.message or "is not shape[0]" in refused.value.message


def test_proto_package_is_the_draft_one() -> None:
    """Draft protos live in refengine.v1alpha1 and only import openengine.v1 (never extend it)."""
    assert media.DESCRIPTOR.package == "refengine.v1alpha1"
    assert {d.name for d in media.DESCRIPTOR.dependencies} == {
        "google/protobuf/struct.proto", "openengine/v1/generation.proto", "openengine/v1/kv.proto"}
    assert all(m.full_name.startswith("refengine.v1alpha1.") for m in media.DESCRIPTOR.message_types_by_name.values())
