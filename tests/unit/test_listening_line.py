"""The line ``refengine serve`` prints for each listener, read back (``protocol.addresses``): the
server writes it and the tests and ``benchmarks/serving.py`` read it with the same module, so a
change of the format cannot leave a reader behind. Here a real server's line is read, not only
the module's own."""

from __future__ import annotations

import re
import subprocess
import sys

from refengine.protocol.addresses import announced_listeners, listening_line


def test_lines_read_back_per_service() -> None:
    output = "\n".join(["INFO something else", listening_line("0.0.0.0:5", ["Inference"]),
                        listening_line("[::1]:6", ["Control"]), ""])
    assert announced_listeners(output) == {"Inference": "0.0.0.0:5", "Control": "[::1]:6"}
    assert announced_listeners("refengine: starting\n") == {}


def test_a_real_servers_line_is_read() -> None:
    """The first line a server prints (before the model loads), read from the process itself."""
    proc = subprocess.Popen([sys.executable, "-m", "refengine.cli", "serve", "--host", "127.0.0.1", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
    finally:
        proc.kill()
        proc.wait()
    services = announced_listeners(line)
    assert set(services) == {"Inference", "Control"}, line
    assert re.fullmatch(r"127\.0\.0\.1:[1-9]\d*", services["Inference"]), line
