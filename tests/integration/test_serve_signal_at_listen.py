"""A signal sent as soon as ``refengine serve`` announces its listeners: a supervisor reads the
port from that line (README) and may stop the server at once. Found by review: the lines came
before the signal handlers, so such a SIGTERM killed the process (exit -15, no drain) and a
SIGINT raised inside gRPC's start (exit 130, a traceback)."""

from __future__ import annotations

import signal
import time

import pytest

from refengine.protocol.addresses import announced_listeners
from tests.integration.conftest import start_server


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_right_after_the_listening_line_stops_cleanly(sig: int, tmp_path) -> None:
    server = start_server(tmp_path / "server.log", wait_ready=False)
    try:
        deadline = time.monotonic() + 120
        while not announced_listeners(server.log_tail(chars=1 << 20)):  # polled closely: the window was short
            assert server.proc.poll() is None and time.monotonic() < deadline, server.log_tail()
            time.sleep(0.001)
        server.signal(sig)
        code = server.proc.wait(timeout=60)
    finally:
        server.stop()
    log = server.log_tail(chars=1 << 20)
    assert code == 0, f"exit {code}:\n{log}"
    assert "first signal received" in log and "Traceback" not in log, log
