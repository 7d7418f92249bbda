"""``refengine serve`` refuses settings it cannot honour at start (exit 2, one line), before
loading anything: out-of-range ports (gRPC would bind the port modulo 65536, possibly another
server's), a wildcard ``--advertise-host`` (E6: it is what clients are told to connect to), an
unknown log level."""

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
])
def test_settings_refused_at_start(capsys: pytest.CaptureFixture[str], args: list[str], says: str) -> None:
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("refengine serve: ") and says in err and err.count("\n") == 1, err


def test_log_level_is_one_of_the_known_levels(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["serve", "--log-level", "debug"]).log_level == "DEBUG"
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--log-level", "FOO"])
    assert exc.value.code == 2 and "invalid choice: 'FOO'" in capsys.readouterr().err
