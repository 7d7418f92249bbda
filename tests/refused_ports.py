"""Loopback ports that refuse connections, for tests of what a client does when nothing listens.

The port stays bound (not listening) while the block runs, so no other server can take it. A
port bound and closed beforehand once answered: a negative control's toy server, started
meanwhile, had been given it."""

from __future__ import annotations

import socket
import threading
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


@contextmanager
def http1_address() -> Iterator[str]:
    """``127.0.0.1:PORT`` of a plain HTTP/1.1 server while the block runs: it reads what comes and
    answers 400, as a web server does to a gRPC client's HTTP/2 preface."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed: the block ended
                return
            with conn:
                conn.settimeout(2)
                try:
                    conn.recv(4096)
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                except OSError:  # the client left first
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone does not, on Linux)
        listener.close()
        thread.join(timeout=5)
