"""K11's shape rules on hand-made ``KvConnectorInfo`` bytes (no server): what a release client
sees of a pre-release connector, a defaulted version, and an endpoint with a field it lacks."""

from __future__ import annotations

from refengine.conformance.checks_kv_connector import connector_problems
from refengine.protocol import oe

RELEASE = oe.KvConnectorInfo(enabled=True, transfer_backend="nixl", supported_protocols=["nixl"],
                             local_endpoints=[oe.KvEndpoint(host="10.0.0.2", port=5600, protocol="nixl")],
                             supports_remote_prefill=True, supports_abort_cleanup=True, schema_version=1)


def parsed(data: bytes) -> oe.KvConnectorInfo:
    message = oe.KvConnectorInfo()
    message.ParseFromString(data)
    return message


def test_a_release_connector_and_a_disabled_one_have_no_problem() -> None:
    assert connector_problems(RELEASE) == []
    assert connector_problems(oe.KvConnectorInfo(enabled=False)) == []
    assert connector_problems(oe.KvConnectorInfo()) == []  # nothing reported


def test_k11_a_pre_release_connector_shows_its_field_9() -> None:
    """The pre-release wire: supports_drain = true as field 8, schema_version = 1 as field 9. A
    release client reads field 8 as schema_version and keeps field 9 as an unknown field."""
    pre_release = parsed(oe.KvConnectorInfo(enabled=True).SerializeToString() + bytes([8 << 3, 1, 9 << 3, 1]))
    assert pre_release.schema_version == 1
    (problem,) = connector_problems(pre_release)
    assert "field 9" in problem and "fields 1-8" in problem


def test_k11_schema_version_present_as_zero_is_a_defaulted_value() -> None:
    (problem,) = connector_problems(oe.KvConnectorInfo(enabled=True, schema_version=0))
    assert "schema_version is present with value 0" in problem


def test_k11_an_endpoint_field_the_release_lacks() -> None:
    endpoint = oe.KvEndpoint(host="h", port=1, protocol="p").SerializeToString() + bytes([7 << 3, 2])
    data = RELEASE.SerializeToString() + bytes([3 << 3 | 2, len(endpoint)]) + endpoint
    (problem,) = connector_problems(parsed(data))
    assert "local_endpoints[1] carries field 7" in problem
