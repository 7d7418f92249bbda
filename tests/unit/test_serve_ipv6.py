"""``--host`` takes an IPv6 literal, bracketed or not (found by review: ``--host ::1`` and
``--host ::`` failed to bind, the message blaming the port: the address was given to gRPC
unbracketed, as ``::1:0``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import grpc
import pytest

from refengine.server.options import host_port


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize(("host", "port", "expected"), [
    ("::1", 5, "[::1]:5"), ("[::1]", 5, "[::1]:5"), ("::", 0, "[::]:0"), ("127.0.0.1", 5, "127.0.0.1:5"),
    ("localhost", 5, "localhost:5")])
def test_host_port_brackets_ipv6_literals_only(host: str, port: int, expected: str) -> None:
    assert host_port(host, port) == expected


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback")
@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_serve_listens_on_an_ipv6_literal(host: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen([sys.executable, "-m", "refengine.cli", "serve", "--host", host, "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = server.stdout.readline()  # the listener's line comes before the model loads
        assert line.startswith("refengine: listening on [::1]:"), (line, server.poll())
        port = int(line.split("]:")[1].split()[0])
        channel = grpc.insecure_channel(f"[::1]:{port}")
        grpc.channel_ready_future(channel).result(timeout=30)  # it accepts connections there
        channel.close()
    finally:
        server.terminate()
        deadline = time.monotonic() + 30
        while server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if server.poll() is None:
            server.kill()
        server.communicate()
