"""Which servers an engine pulls KV sessions and embedding handles from (``engine/kv_sources.py``,
``--kv-source-allow``): loopback by default; host names match only themselves, addresses match
listed networks, ``any`` allows every source. Found by review: any endpoint a request named
was dialed, and what it sent entered the prefix cache."""

from __future__ import annotations

import socket

import pytest

from refengine.engine.kv_sources import SourcePolicy
from refengine.types import InvalidRequestError, KvEndpointSpec

LOOPBACK = ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "::ffff:127.0.0.1", "localhost", "LocalHost."]
ELSEWHERE = ["10.0.0.1", "192.168.1.5", "169.254.169.254", "0.0.0.0", "::", "2002:7f00:1::", "fe80::1%eth0",
             "8.8.8.8", "example.com", "localhost.attacker.example", "127.0.0.1.nip.io"]
#: Hosts the dialer reads differently from how they look (found by review: the check took what came
#: before a '%', gRPC percent-decodes and resolves the rest): never a source, whatever is allowed.
MALFORMED = ["127.0.0.1%2Eattacker.example", "127.0.0.1%31", "::1%lo", "[::1%25lo]", "local host", "a/b", "",
             "127.0.0.1:80", "[127.0.0.1]", "prefill-0.svc%00"]


@pytest.mark.parametrize("host", LOOPBACK)
def test_loopback_is_allowed_by_default(host: str) -> None:
    assert SourcePolicy(("loopback",)).allows(host)


@pytest.mark.parametrize("host", ELSEWHERE)
def test_everything_else_is_refused_by_default(host: str) -> None:
    assert not SourcePolicy(("loopback",)).allows(host)


def test_this_machine_s_host_name_is_loopback() -> None:
    """What a prefill server bound to a wildcard advertises: one host needs no flag."""
    assert SourcePolicy(("loopback",)).allows(socket.gethostname())
    assert not SourcePolicy(("10.0.0.0/8",)).allows(socket.gethostname())


def test_networks_and_names_match_what_they_list_only() -> None:
    policy = SourcePolicy(("10.0.0.0/8", "fd00::/8", "Prefill-0.svc", "192.168.1.7"))
    assert [policy.allows(h) for h in ("10.2.3.4", "11.0.0.1", "fd12::5", "fe80::1", "192.168.1.7",
                                       "192.168.1.8", "prefill-0.svc", "PREFILL-0.SVC.", "prefill-1.svc",
                                       "127.0.0.1", "localhost")] == \
        [True, False, True, False, True, False, True, True, False, False, False]


def test_any_allows_every_source() -> None:
    assert all(SourcePolicy(("any",)).allows(h) for h in ELSEWHERE + LOOPBACK if "%" not in h)


@pytest.mark.parametrize("host", MALFORMED)
def test_a_host_the_dialer_would_read_otherwise_is_never_allowed(host: str) -> None:
    for allowed in (("loopback",), ("any",), ("127.0.0.0/8", "::/0", "prefill-0.svc")):
        assert not SourcePolicy(allowed).allows(host), (allowed, host)


def test_any_takes_every_name_a_resolver_takes() -> None:
    """Found by review of the host check: a Docker service name (an underscore) was refused under `any`."""
    assert SourcePolicy(("any",)).allows("prefill_server")
    assert SourcePolicy(("prefill_server",)).allows("prefill_server")


def test_entries_written_with_a_final_dot_or_ipv4_mapped_match() -> None:
    """Found by review: both were accepted and then matched nothing."""
    policy = SourcePolicy(("prefill.example.", "::ffff:10.0.0.0/104"))
    assert [policy.allows(h) for h in ("prefill.example.", "PREFILL.example", "10.9.8.7", "::ffff:10.0.0.1",
                                       "11.0.0.1")] == [True, True, True, True, False]


def test_a_refusal_names_the_endpoint_and_the_flag() -> None:
    endpoints = [KvEndpointSpec("127.0.0.1", 7000, "grpc"), KvEndpointSpec("10.1.1.1", 7001, "nixl")]
    with pytest.raises(InvalidRequestError, match=r"^kv.session: endpoint 10.1.1.1:7001 is not a source this server "
                                                  r"pulls from \(--kv-source-allow: loopback\)$"):
        SourcePolicy(("loopback",)).check(endpoints, "kv.session")
    SourcePolicy(("loopback", "10.0.0.0/8")).check(endpoints, "kv.session")
