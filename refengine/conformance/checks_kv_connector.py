"""K11 — ``ServerInfo.kv_connector``: what a server says about its KV connector.

A framework reads ``KvConnectorInfo`` once, at discovery, to decide how to pair prefill and
decode servers, so it must be static per deployment. Its wire shape is the release's: fields
1–8 only. A server built from the pre-release copy (commit 4def7c5) sends ``supports_drain``
as field 8, which a release client reads as ``schema_version``, and ``schema_version`` as field
9, which a release client cannot read at all; the check reports any field it does not know.
Optional scalars follow D2: present means reported, so a present ``schema_version`` of 0 (no
schema has that number) is a defaulted value that should have been absent.

"Reported only in ``ServerInfo.kv_connector``" is a property of the release's messages (no
other message has connector fields), so a client has nothing more to check there.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.unknown_fields import UnknownFieldSet

from refengine.conformance.registry import check, expect
from refengine.conformance.target import Target
from refengine.protocol import oe


def connector_problems(connector: Any) -> list[str]:
    """What in one ``KvConnectorInfo`` breaks K11's shape: unknown fields, a present 0 version."""
    problems = [f"kv_connector carries field {f.field_number} (wire type {f.wire_type}), which the release's "
                "KvConnectorInfo does not have (fields 1-8; a pre-release server sends schema_version as 9)"
                for f in UnknownFieldSet(connector)]
    for i, endpoint in enumerate(connector.local_endpoints):
        problems += [f"kv_connector.local_endpoints[{i}] carries field {f.field_number}, unknown to the release's "
                     "KvEndpoint" for f in UnknownFieldSet(endpoint)]
    if connector.HasField("schema_version") and connector.schema_version == 0:
        problems.append("kv_connector.schema_version is present with value 0: an unknown version must be absent "
                        "(D2), and no schema has number 0")
    return problems


def _reported(info: Any) -> tuple[bool, bytes]:
    """The connector as a comparable value: whether it is there, and its exact bytes."""
    return info.HasField("kv_connector"), info.kv_connector.SerializeToString(deterministic=True)


def _describe(info: Any) -> str:
    if not info.HasField("kv_connector"):
        return "<absent>"
    return " ".join(str(info.kv_connector).split()) or "<empty>"


def _one_server(s: Target, name: str) -> str:
    """K11 on one server: its shape now, and the same bytes during a request and after it."""
    first = s.server_info
    problems = connector_problems(first.kv_connector)
    expect(not problems, f"{name}: " + "; ".join(problems))
    busy = None
    if first.engine_role == oe.ENGINE_ROLE_AGGREGATED:  # a PREFILL server would hold a session, a DECODE one needs one
        busy = s.generate_async(s.request("k11", max_tokens=16, ignore_eos=True))
        s.wait_busy(lambda load: load.running_requests > 0 or load.queued_requests > 0, timeout=5)
    during = s.unary("GetServerInfo", oe.GetServerInfoRequest())
    if busy is not None:
        busy.join()
    after = s.unary("GetServerInfo", oe.GetServerInfoRequest())
    for when, info in (("while a request ran" if busy else "on a second call", during), ("afterwards", after)):
        expect(_reported(info) == _reported(first),
               f"{name}: kv_connector changed {when}: {_describe(first)} -> {_describe(info)}; it is static per "
               "deployment")
    if busy is not None:
        s.wait_idle("K11")
    return f"{name}: {_describe(first)}"


@check("K11", "ServerInfo.kv_connector is static, has only the release's fields 1-8, and presence as D2")
def kv_connector_static(t: Target) -> str:
    """K11 on the target and on the ``--prefill``/``--decode`` servers of the run, when named."""
    servers = [("target", t)]
    for name, address in (("--prefill", t.options.prefill_address), ("--decode", t.options.decode_address)):
        if address:
            servers.append((name, t.connect_peer(address, name)))
    return "; ".join(_one_server(s, name) for name, s in servers)
