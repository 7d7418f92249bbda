"""Loopback ports that refuse connections, for tests of what a client does when nothing listens.

The port stays bound (not listening) while the block runs, so no other server can take it. A
port bound and closed beforehand once answered: a negative control's toy server, started
meanwhile, had been given it."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def refused_port() -> Iterator[int]:
    """A port on 127.0.0.1 that refuses connections while the block runs."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@contextmanager
def refused_address() -> Iterator[str]:
    """``127.0.0.1:PORT`` of :func:`refused_port`."""
    with refused_port() as port:
        yield f"127.0.0.1:{port}"
