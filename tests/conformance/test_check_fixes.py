"""Conforming answers the suite once failed, and violations it once blamed on the wrong rule,
each against the toy server (tests/conformance/fake_server.py): a server without the optional
GetLoad, one faster than the deadline checks' deadlines, one whose token events lack request_id,
one forgetting finished ids. (A server without usage, and one sending every output in one
TokenOutput, run the whole suite among the negative controls: test_negative_controls.py.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import tests.conformance.toy_engine as toy_engine
from refengine.conformance import Options, Result, Status, run, run_report, select
from refengine.conformance.load import LoadOptions, run_load
from tests.conformance.fake_server import Faults, serve
from tests.conformance.test_conformance_cli_errors import _NoLoad, _stop, _toy_with


def _run(faults: Faults, rules: list[str]) -> dict[str, Result]:
    server, address, engine = serve(faults)
    try:
        return {r.name: r for r in run(address, rules, Options(idle_timeout_s=2.0))}
    finally:
        _stop(server, engine)


def _failed(results: dict[str, Result]) -> dict[str, str]:
    return {n: r.message for n, r in results.items() if r.status is Status.FAIL}


@pytest.fixture(scope="module")
def no_load() -> Iterator[str]:
    server, address, engine = _toy_with(_NoLoad)
    try:
        yield address
    finally:
        _stop(server, engine)


def test_a_server_without_getload_fails_no_core_check(no_load: str) -> None:
    """GetLoad is optional: the checks that only wait for idle go on, A4 checks its CANCELLED
    finishes, and A5 (which is about releasing work) skips, naming GetLoad. Before, 20 core
    checks failed with 'unexpected gRPC status UNIMPLEMENTED'."""
    rules = ["D6", "M4", "M5", "G7", "G13", "G17", "G18", "A3", "A4", "A5", "X1", "X4"]
    results = {r.name: r for r in run(no_load, rules, Options(idle_timeout_s=2.0))}
    assert not _failed(results), _failed(results)
    assert results["A4:abort_running"].status is Status.PASS, results["A4:abort_running"]
    assert "GetLoad unavailable" in results["A4:abort_running"].message
    for name in ("A5:client_cancel", "A5:client_disconnect", "A5:client_deadline", "M4:priority"):
        assert results[name].status is Status.SKIP and "GetLoad answered UNIMPLEMENTED" in results[name].message


def test_load_mode_without_getload_reports_idle_not_claimed(no_load: str) -> None:
    """The load mode's idle result cannot be judged without GetLoad: NOT_CLAIMED, not a crash."""
    report = run_load(run_report(no_load, select(["G1"])), no_load, Options(), LoadOptions(2, 1.0, 0))
    idle = next(r for r in report.results if r.name == "H4:load_idle_after")
    assert idle.status is Status.NOT_CLAIMED and "GetLoad" in idle.message, idle


def test_a_server_faster_than_the_deadlines_is_skipped_not_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream that completes before the client's deadline shows no transport failure: skipped.
    Before, A5 and X1 failed a fast server ('0.4 s deadline: status OK')."""
    monkeypatch.setattr(toy_engine, "STEP_S", 0.0002)  # ~10,000 tokens/s: 864 tokens well under 0.4 s
    results = _run(Faults(), ["A5", "X1"])
    assert not _failed(results), _failed(results)
    for name in ("A5:client_deadline", "X1:transport_failure"):
        assert results[name].status is Status.SKIP and "before its" in results[name].message, results[name]


def test_the_stop_fallback_still_fails_a_leaked_stop() -> None:
    """The stop-string fallback still catches a stop string left in the text (with real deltas)."""
    results = _run(Faults(leak_stop=True), ["G14"])
    assert results["G14:stop_string_held_back"].status is Status.FAIL


def test_a_token_event_without_request_id_fails_g9_alone() -> None:
    """A5's disconnect check read the first event's request_id: a G9 violation failed A5 too."""
    results = _run(Faults(token_without_request_id=True), ["G9", "A5"])
    assert set(_failed(results)) == {"G9:request_id_echo"}, _failed(results)


def test_forgotten_finished_ids_fail_a2_alone() -> None:
    """ALREADY_FINISHED for a finished id is A2's; A4's second Abort only must not find it running."""
    results = _run(Faults(finished_ids_forgotten=True), ["A2", "A4"])
    assert set(_failed(results)) == {"A2:abort_unknown_and_finished"}, _failed(results)
