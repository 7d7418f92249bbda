"""E6, D7, K4: a host a server advertises must be one a client can connect to.

The conformance suite imports nothing of the engine it may be checking, so this is its own
statement of the rule (the server's is ``refengine/server/options.py``); both are tested on
the same spellings.
"""

from __future__ import annotations

import ipaddress


def bare_host(host: str) -> str:
    """``host`` as a resolver reads it: no surrounding space, no IPv6 brackets, lower case."""
    return host.strip().removeprefix("[").removesuffix("]").lower()


def is_same_machine(host: str, target_host: str) -> bool:
    """``host`` is a loopback address, ``localhost``, or the host the suite reached the target at
    (E6: a connection refused there means nothing listens)."""
    host = bare_host(host)
    if host in ("localhost", bare_host(target_host)):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_wildcard_host(host: str) -> bool:
    """A bind address meaning "every interface": empty, ``*``, or any spelling of an unspecified
    IP (``0.0.0.0``, ``::``, ``[::]``, ``::0``, ``0:0:0:0:0:0:0:0``, ``::ffff:0.0.0.0``)."""
    host = host.strip()
    if host in ("", "*"):
        return True
    try:
        ip = ipaddress.ip_address(bare_host(host))
    except ValueError:  # a name, not an IP literal
        return False
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return ip.is_unspecified or (mapped is not None and mapped.is_unspecified)


def is_routable(host: str, port: int) -> bool:
    """``host:port`` can be dialled: a non-wildcard host and a TCP port in 1..65535."""
    return not is_wildcard_host(host) and 0 < port < 65536
