"""``refengine serve`` refuses settings it cannot honour at start (exit 2, one line), before
loading anything: out-of-range ports (gRPC would bind the port modulo 65536, possibly another
server's), ZMQ endpoints that are malformed or share a port, a wildcard ``--advertise-host``
(E6: it is what clients are told to connect to), an unknown log level, a ZMQ KV event source
on a server without KV events."""

from __future__ import annotations

import pytest

from refengine.cli import build_parser, main


@pytest.mark.parametrize(("args", "says"), [
    (["--port", "70000"], "--port must be in 0..65535 (0: a free port), got 70000"),
    (["--port", "-1"], "--port must be in 0..65535"),
    (["--control-port", "65536"], "--control-port must be in 0..65535"),
    (["--advertise-host", "0.0.0.0"], "--advertise-host '0.0.0.0' is a bind wildcard"),
    (["--advertise-host", "::"], "--advertise-host '::' is a bind wildcard"),
    (["--advertise-host", " "], "is a bind wildcard"),
    (["--advertise-host", "::0"], "--advertise-host '::0' is a bind wildcard"),
    (["--advertise-host", "0:0:0:0:0:0:0:0"], "is a bind wildcard"),
    (["--advertise-host", "[::]"], "is a bind wildcard"),
    (["--advertise-host", "::ffff:0.0.0.0"], "is a bind wildcard"),
    (["--advertise-host", "*"], "is a bind wildcard"),
    # A ZMQ source without KV events crashed with a traceback once the model had loaded (found by review).
    (["--kv-events-zmq", "tcp://127.0.0.1:0", "--no-kv-events"], "--kv-events-zmq needs KV events"),
    (["--kv-events-zmq", "tcp://127.0.0.1:0", "--role", "encoder"], "--kv-events-zmq needs KV events"),
    (["--port", "8100", "--control-port", "8100"], "--control-port 8100 is --port"),  # a bind traceback before
    # Hosts (found by review: they failed to bind, blamed on --port, after gRPC's own log lines).
    *[(["--host", host], f"--host must be a host name or an IP address, got {host!r}")
      for host in ("", "\u00ff", " 127.0.0.1", "127.0.0.1:80")],
    (["--port", "0", "--control-port", "0", "--control-host", "a b"], "--control-host must be a host name"),
    (["--advertise-host", "http://x"], "--advertise-host must be a host name or an IP address"),
    (["--instance-id", ""], "--instance-id must be a non-empty name"),  # was replaced by a random id, silently
    (["--enable-lora", "--lora-root", "/nonexistent-lora-root"], "--lora-root /nonexistent-lora-root: not a directory"),
    # ZMQ endpoints (found by review): a port past 65535 was bound modulo 65536 and advertised so; a
    # port shared with another socket or a gRPC listener failed only after the model had loaded.
    (["--kv-events-zmq", "tcp://127.0.0.1:99999"], "--kv-events-zmq: KV event endpoint port must be in 0..65535"),
    (["--kv-events-zmq", "garbage"], "--kv-events-zmq: KV event endpoint must be tcp://HOST:PORT"),
    (["--port", "47003", "--kv-events-zmq", "tcp://127.0.0.1:47003"], "port 47003 is --port's"),
    (["--port", "0", "--control-port", "47004", "--kv-events-zmq", "tcp://*:47004"], "port 47004 is --control-port's"),
    (["--kv-events-zmq", "tcp://127.0.0.1:47005", "--kv-events-zmq-replay", "tcp://127.0.0.1:47005"],
     "--kv-events-zmq-replay tcp://127.0.0.1:47005: port 47005 is --kv-events-zmq's"),
])
def test_settings_refused_at_start(capsys: pytest.CaptureFixture[str], args: list[str], says: str) -> None:
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("refengine serve: ") and says in err and err.count("\n") == 1, err


@pytest.mark.parametrize("flag", ["--kv-events-zmq", "--kv-events-zmq-replay"])
def test_a_busy_zmq_port_is_refused_before_the_model_loads(capsys: pytest.CaptureFixture[str], flag: str) -> None:
    """It crashed with a traceback and exit 1 once the model had loaded (found by review)."""
    zmq = pytest.importorskip("zmq")
    holder = zmq.Context.instance().socket(zmq.PUB)
    try:
        port = holder.bind_to_random_port("tcp://127.0.0.1")
        busy = f"tcp://127.0.0.1:{port}"
        args = ["--kv-events-zmq", busy] if flag == "--kv-events-zmq" else \
            ["--kv-events-zmq", "tcp://127.0.0.1:0", "--kv-events-zmq-replay", busy]
        assert main(["serve", *args]) == 2
    finally:
        holder.close(linger=0)
    err = capsys.readouterr().err
    assert err.startswith(f"refengine serve: {flag} {busy}: ") and "in use" in err and err.count("\n") == 1, err


def test_log_level_is_one_of_the_known_levels(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["serve", "--log-level", "debug"]).log_level == "DEBUG"
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--log-level", "FOO"])
    assert exc.value.code == 2 and "invalid choice: 'FOO'" in capsys.readouterr().err


@pytest.mark.parametrize(("host", "wildcard"), [
    ("", True), ("*", True), ("0.0.0.0", True), ("::", True), ("[::]", True), ("::0", True), ("[::0]", True),
    ("0:0:0:0:0:0:0:0", True), ("::ffff:0.0.0.0", True), (" 0.0.0.0 ", True),
    ("127.0.0.1", False), ("::1", False), ("10.0.0.7", False), ("prefill-0.cluster.local", False), ("0", False),
])
def test_every_spelling_of_a_wildcard_is_one(host: str, wildcard: bool) -> None:
    """E6: the server checks advertised hosts (ServerInfo, KV event sources, KV session endpoints)
    and the endpoints a decode request names with one helper, the conformance suite (which
    imports nothing of the engine) with its own: both agree. ``::0`` passed both before."""
    from refengine.conformance import hosts
    from refengine.server import options

    assert options.is_wildcard_host(host) is wildcard
    assert hosts.is_wildcard_host(host) is wildcard
    assert hosts.is_routable(host, 50051) is not wildcard
