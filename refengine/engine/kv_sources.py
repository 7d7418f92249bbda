"""Which servers this engine pulls from: the endpoints of a decode request's KV session and of
a request's embedding handles are named by the request, and what is pulled from them enters the
prefix cache (and the KV events) under the request's prompt and image identities. A client that
names a server of its own could put made-up KV or image rows there for every later client with
that prompt or image, and have this server dial any address it likes. So each endpoint is
checked before acceptance against ``KvTransferConfig.allowed_sources`` (``--kv-source-allow``):
by default this host only: the loopback addresses, ``localhost`` and the machine's own host name
(what a server bound to a wildcard advertises), so prefill, encoder and consumer on one host
need no flag. A host name matches only itself (it is not resolved: a name could resolve
elsewhere by the time the pull dials it); an address matches a listed network; ``any`` trusts
every client to name sources.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable

from refengine.config_checks import ANY_SOURCE, LOOPBACK_SOURCES, is_host_name, source_entry
from refengine.types import InvalidRequestError, KvEndpointSpec


def loopback_names() -> tuple[str, ...]:
    """The names of this host: ``localhost``, and its host name (``socket.gethostname``)."""
    return ("localhost", socket.gethostname().lower().rstrip("."))


def _unmapped(network: ipaddress.IPv4Network | ipaddress.IPv6Network) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """An IPv4-mapped IPv6 network as the IPv4 network it maps (addresses are compared unmapped)."""
    mapped = network.network_address.ipv4_mapped if isinstance(network, ipaddress.IPv6Network) else None
    if mapped is None or network.prefixlen < 96:
        return network
    return ipaddress.ip_network(f"{mapped}/{network.prefixlen - 96}")


class SourcePolicy:
    def __init__(self, allowed: Iterable[str]) -> None:
        self.allowed = tuple(allowed)
        entries = [source_entry(entry) for entry in self.allowed]
        self._any = ANY_SOURCE in entries
        self._loopback = LOOPBACK_SOURCES in entries
        self._networks = [_unmapped(e) for e in entries if isinstance(e, ipaddress.IPv4Network | ipaddress.IPv6Network)]
        self._names = {e for e in entries if isinstance(e, str)} - {ANY_SOURCE, LOOPBACK_SOURCES}
        if self._loopback:
            self._names |= set(loopback_names())

    def allows(self, host: str) -> bool:
        """Whether ``host`` (as dialed) is an allowed source. Only a plain IP address (IPv6 in
        brackets or not, no zone) or host name is: the dialer percent-decodes and resolves
        what it is given, so ``127.0.0.1%2Eattacker.example`` must not pass as 127.0.0.1."""
        bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            address = ipaddress.ip_address(bare)
        except ValueError:
            return is_host_name(host) and (self._any or host.lower().rstrip(".") in self._names)
        if "%" in bare or (bare != host and address.version == 4):  # a zone id; brackets are IPv6's
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return self._any or (self._loopback and address.is_loopback) or any(address in net for net in self._networks)

    def check(self, endpoints: Iterable[KvEndpointSpec], where: str) -> None:
        """Raise ``InvalidRequestError`` naming the first endpoint not allowed."""
        for endpoint in endpoints:
            if not self.allows(endpoint.host):
                raise InvalidRequestError(
                    f"{where}: endpoint {endpoint.host}:{endpoint.port} is not a source this server pulls from "
                    f"(--kv-source-allow: {', '.join(self.allowed)})")
