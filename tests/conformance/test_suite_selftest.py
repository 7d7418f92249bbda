"""The conformance suite checked against a toy server (fast, no model): it passes a
server that follows the rules, and catches one that breaks them."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from refengine.conformance import Options, Status, run, select
from refengine.conformance.registry import rule_section, rules_in
from tests.conformance.fake_server import Faults, serve
from tests.conformance.test_conformance import COVERED_SECTIONS, REPO, rules_markdown


@pytest.fixture(scope="module")
def toy_address() -> Iterator[str]:
    server, address, engine = serve()
    yield address
    server.stop(0)
    engine.running = False


def test_toy_server_passes_the_whole_suite(toy_address: str) -> None:
    results = run(toy_address)
    failed = [f"{r.name}: {r.message}" for r in results if r.status is Status.FAIL]
    assert not failed, "\n".join(failed)
    assert {r.rule for r in results} >= set(rules_in(rules_markdown(), COVERED_SECTIONS))


@pytest.mark.parametrize(
    ("faults", "rules", "must_fail"),
    [
        (Faults(leak_stop=True), ["G14"], "G14:stop_string_held_back"),
        (Faults(usage_every_event=True), ["G16", "G13"], "G16:usage_accounting"),
        (Faults(ignore_disconnect=True), ["A5"], "A5:client_cancel"),
    ],
    ids=["stop-leak", "usage-everywhere", "ignores-disconnect"],
)
def test_suite_catches_a_broken_server(faults: Faults, rules: list[str], must_fail: str) -> None:
    server, address, engine = serve(faults)
    try:
        results = run(address, rules, Options(idle_timeout_s=1.0))
    finally:
        server.stop(0)
        engine.running = False
    by_name = {r.name: r for r in results}
    assert by_name[must_fail].status is Status.FAIL, by_name[must_fail]


def test_cli_matrix_json_and_exit_code(toy_address: str, tmp_path) -> None:  # noqa: ANN001
    out = tmp_path / "matrix.json"
    proc = subprocess.run([sys.executable, "-m", "refengine.conformance", toy_address, "--rules", "D1,G1,A",
                           "--json", str(out), "--quiet"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| D1 | D |" in proc.stdout and "| A5 | A |" in proc.stdout
    data = json.loads(out.read_text())
    assert {r["rule"] for r in data["results"]} == {"D1", "G1", "A1", "A2", "A3", "A4", "A5"}
    assert all(r["status"] == "PASS" for r in data["results"])


def test_cli_exits_nonzero_on_failure(tmp_path) -> None:  # noqa: ANN001
    server, address, engine = serve(Faults(leak_stop=True))
    try:
        proc = subprocess.run([sys.executable, "-m", "refengine.conformance", address, "--rules", "G14", "--quiet"],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
    finally:
        server.stop(0)
        engine.running = False
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "| G14 | G |" in proc.stdout and "FAIL" in proc.stdout


def test_registry_selection() -> None:
    assert {c.section for c in select(["L"])} == {"L"}
    assert {c.rule for c in select(["G14", "A1"])} == {"G14", "A1"}
    with pytest.raises(ValueError):
        select(["Z9"])
    with pytest.raises(ValueError):
        rule_section("G")
