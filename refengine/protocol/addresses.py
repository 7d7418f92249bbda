"""How an OpenEngine server's address is written on a command line: ``HOST:PORT`` (a name, an
IPv4 address or a bracketed IPv6 one, and a TCP port). Shared by every client-side command (the
client, bench, conformance) so that a mistyped address is refused at once, naming the flag,
instead of waiting out a connect timeout (found by review).

Also the line ``refengine serve`` prints for each listener once every listener is bound, and
its reading: a supervisor that passes ``--port 0`` learns the ports from it (the tests and
``benchmarks/serving.py`` do)."""

from __future__ import annotations

import re
from collections.abc import Sequence

_LISTENING = re.compile(r"^refengine: listening on (\S+) \(([^)]*)\)$", re.MULTILINE)


def check_address(address: str) -> str:
    """``address`` when it reads as ``HOST:PORT`` with a port in 1..65535; else ValueError."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT with a port in 1..65535, got {address!r}")
    if "/" in host:  # a URL (http://h:1): it read as host "http://h" and failed only at connect (found by review)
        raise ValueError(f"expected HOST:PORT, no scheme or path, got {address!r}")
    return address


def listening_line(address: str, services: Sequence[str]) -> str:
    """What ``refengine serve`` prints for a listener at ``address`` serving ``services`` (short
    names: ``Inference``, ``Control``)."""
    return f"refengine: listening on {address} ({' + '.join(services)})"


def announced_listeners(output: str) -> dict[str, str]:
    """Service name -> the HOST:PORT ``output`` (a ``refengine serve``'s) announced for it in
    ``listening_line``s; empty until the server printed them."""
    return {name: where for where, names in _LISTENING.findall(output) for name in names.split(" + ")}
