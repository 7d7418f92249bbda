"""How an OpenEngine server's address is written on a command line: ``HOST:PORT`` (a name, an
IPv4 address or a bracketed IPv6 one, and a TCP port). Shared by every client-side command (the
client, bench, conformance) so that a mistyped address is refused at once, naming the flag,
instead of waiting out a connect timeout (found by review)."""

from __future__ import annotations


def check_address(address: str) -> str:
    """``address`` when it reads as ``HOST:PORT`` with a port in 1..65535; else ValueError."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT with a port in 1..65535, got {address!r}")
    return address
