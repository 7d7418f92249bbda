"""``refengine conformance`` when the command line or the target is wrong: a one-line error and
exit 2, before any check runs; and the statuses a run reports when it could observe nothing
(skipped, never pass)."""

from __future__ import annotations

import json
import time
from concurrent import futures
from typing import Any

import grpc
import pytest

from refengine.conformance import Options, Status, command, run_report, select
from refengine.conformance.command import main
from refengine.conformance.registry import CheckFailed
from refengine.conformance.report import to_dict
from refengine.conformance.runner import TargetLost
from refengine.conformance.streams import Background
from refengine.conformance.target import BACKGROUND_JOIN_MARGIN_S, ConnectError, Target
from tests.conformance.fake_server import Control, Faults, Inference, start
from tests.conformance.toy_engine import ToyEngine
from tests.conformance.toy_roles import serve_pair

#: Nothing listens there: a command line checked only after connecting would say "cannot connect".
NOWHERE = "127.0.0.1:1"



def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main([*args, "--quiet"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("args", "says"), [
    (["--known-extra-keys", "{bad"], "--known-extra-keys: not JSON"),
    (["--slow-reader-extra", "[1]"], "--slow-reader-extra: a JSON object is needed, got list"),
    (["--load", "2", "--duration", "0"], "--load needs 1 <= N <= 256 and --duration > 0"),
    (["--load", "-1"], "--load needs 1 <= N <= 256"),
    (["--load", "257"], "--load needs 1 <= N <= 256"),  # 20,000 threads hit their own deadlines, blamed on G12
    (["--json", "/nonexistent-dir/r.json"], "--json /nonexistent-dir/r.json: cannot be written"),
    (["--json", "/tmp"], "--json /tmp: cannot be written"),  # a directory: it crashed after the whole run
    (["--profile", "lora", "--rules", "G1"], "no check is both in --rules G1 and in --profile lora"),
    (["--rules", ",,"], "--rules ',,' names no rule"),  # ran the whole suite
    (["--control", "http://h:1"], "--control"),
    (["--timeout", "0"], "--timeout must be in (0, 1e+07] seconds"),
    (["--timeout", "nan"], "--timeout must be in"),  # passed "> 0" and failed G1 with DEADLINE_EXCEEDED
    (["--rpc-timeout", "inf"], "--rpc-timeout must be in"),  # OverflowError: timestamp out of range
    (["--event-wait", "0"], "--event-wait must be in"),  # every KV-event wait would end at once
    (["--load", "1", "--duration", "nan"], "--load needs 1 <= N <= 256 and --duration > 0"),
    (["--media-placeholder-token-id", "-3"], "--media-placeholder-token-id must be a token id"),  # failed D9/G19
])
def test_a_bad_command_line_is_refused_before_connecting(capsys: pytest.CaptureFixture[str], args: list[str],
                                                         says: str) -> None:
    code, err = _main(capsys, NOWHERE, "--rpc-timeout", "30", *args)
    assert code == 2 and err.startswith("conformance: error: ") and says in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


class _NoModelInfo(Control):
    def GetModelInfo(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "not here")


class _NoModels(Control):
    def GetServerInfo(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        info = super().GetServerInfo(request, context)
        del info.supported_models[:]
        return info


class _NoLoad(Control):
    def GetLoad(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "no load figures")


class _ManySlots(Control):
    """M4 cannot be observed: the toy ignores priority, but reports 16 running slots."""

    def GetServerInfo(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        info = super().GetServerInfo(request, context)
        info.capacity.max_running_requests = 16
        return info


class _SmallContext(Control):
    """G18's chunked prompt (1.5 x max_batched_tokens 64) does not fit a 100-token context."""

    def GetModelInfo(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        info = super().GetModelInfo(request, context)
        info.max_context_length = 100
        return info


def _toy_with(control: type[Control], faults: Faults | None = None) -> tuple[grpc.Server, str, ToyEngine]:
    engine = ToyEngine(faults or Faults())
    server, address = start(engine, Inference(engine), control(engine))
    return server, address, engine


def _stop(server: grpc.Server, engine: ToyEngine) -> None:
    server.stop(0)
    engine.running = False


@pytest.mark.parametrize(("control", "says"), [
    (_NoModelInfo, 'discovery failed: GetModelInfo(model: "toy") answered UNIMPLEMENTED: not here'),
    (_NoModels, "GetServerInfo lists no supported model; name one with --model"),
])
def test_a_target_whose_discovery_fails_exits_2(capsys: pytest.CaptureFixture[str], control: type[Control],
                                                says: str) -> None:
    server, address, engine = _toy_with(control)
    try:
        code, err = _main(capsys, "--target", address, "--rules", "D1")
    finally:
        _stop(server, engine)
    assert code == 2 and err == f"conformance: error: {address}: {says}\n", err


def test_a_grpc_server_that_is_not_openengine_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        code, err = _main(capsys, "--target", f"127.0.0.1:{port}", "--rules", "D1")
    finally:
        server.stop(0)
    assert code == 2 and "GetServerInfo({}) answered UNIMPLEMENTED" in err and err.count("\n") == 1, err


def test_an_unknown_model_exits_2(capsys: pytest.CaptureFixture[str], toy_address: str) -> None:
    code, err = _main(capsys, "--target", toy_address, "--model", "nosuch", "--rules", "D1")
    assert code == 2 and 'GetModelInfo(model: "nosuch") answered NOT_FOUND' in err, err


def test_getload_is_optional(toy_address: str) -> None:
    """A server without GetLoad is tested; only the load profile is not claimed."""
    server, address, engine = _toy_with(_NoLoad)
    try:
        report = run_report(address, select(["D1", "H4"]))
    finally:
        _stop(server, engine)
    statuses = {r.name: r.status for r in report.results}
    assert statuses["D1:schema_revision"] is Status.PASS
    assert statuses["H4:load_presence"] is Status.NOT_CLAIMED
    assert not next(p for p in report.profiles if p.name == "load").claimed


def test_a_claimed_profile_none_of_whose_checks_ran_is_skipped(toy_address: str) -> None:
    profiles = {p["name"]: p["status"] for p in to_dict(run_report(toy_address, select(["D1"])))["profiles"]}
    assert profiles["core"] == "pass"
    assert profiles["load"] == profiles["logprobs"] == profiles["guided"] == "skipped"
    assert profiles["lora"] == "not_claimed"


def test_an_unreachable_named_server_is_a_connect_error_naming_it(capsys: pytest.CaptureFixture[str],
                                                                  toy_address: str) -> None:
    """Before any check (found by review: each K check and K11 of the core profile failed, 10 s
    apiece, for a mistyped --decode): exit 2, naming the flag."""
    options = Options(prefill_address=NOWHERE, decode_address=NOWHERE, rpc_timeout_s=1.0)
    with pytest.raises(ConnectError, match=f"--prefill: cannot connect to {NOWHERE} within 1 s"):
        run_report(toy_address, select(["K4"]), options)
    servers, prefill, _, engines = serve_pair(Faults())
    try:
        code, err = _main(capsys, "--target", toy_address, "--prefill", prefill, "--decode", NOWHERE,
                          "--rpc-timeout", "1", "--rules", "K4")
    finally:
        for server, engine in zip(servers, engines, strict=True):
            server.stop(0)
            engine.running = False
    assert code == 2 and f"--decode: cannot connect to {NOWHERE}" in err, err


@pytest.mark.parametrize(("control", "rule", "name", "says"), [
    (_ManySlots, "M4", "M4:priority", "admission order cannot be observed: max_running_requests 16"),
    (_SmallContext, "G18", "G18:greedy_chunked", "forcing chunking needs a prompt of 103 tokens"),
])
def test_what_cannot_be_observed_is_skipped_not_passed(control: type[Control], rule: str, name: str,
                                                       says: str) -> None:
    """The toy ignores priority here, so a pass would be wrong; it cannot be seen, so: skipped."""
    server, address, engine = _toy_with(control, Faults(ignore_priority=True))
    try:
        results = {r.name: r for r in run_report(address, select([rule])).results}
    finally:
        _stop(server, engine)
    assert results[name].status is Status.SKIP and says in results[name].message, results[name]


def test_an_unknown_role_is_named_not_a_crash(toy_address: str) -> None:
    class UnknownRole(Control):
        def GetServerInfo(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
            info = super().GetServerInfo(request, context)
            info.engine_role = 9
            return info

    server, address, engine = _toy_with(UnknownRole)
    try:
        results = {r.name: r for r in run_report(address, select(["D7", "X4"])).results}
    finally:
        _stop(server, engine)
    assert "ValueError" not in results["D7:engine_role"].message, results["D7:engine_role"]
    assert results["X4:release_enum_values"].status is Status.FAIL


def test_a_target_that_does_not_generate_is_refused_for_the_core_profile(capsys: pytest.CaptureFixture[str]) -> None:
    """Found by review: a PREFILL target failed 38 checks of the core profile (which assumes an
    AGGREGATED target; two crashed inside the suite) while the prefill profile checked nothing. Now
    exit 2, saying where to point the run; checks picked by rule still run against it."""
    servers, prefill, _, _ = serve_pair(Faults())
    try:
        code, err = _main(capsys, prefill, "--rpc-timeout", "30")
        picked = [r.rule for r in run_report(prefill, select(["D7"]), Options(rpc_timeout_s=30.0)).results]
    finally:
        for server in servers:
            server.stop(0)
    assert code == 2 and "engine_role is ENGINE_ROLE_PREFILL" in err and "--prefill/--decode" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert picked == ["D7"]


def test_a_target_that_goes_away_mid_run_exits_2_naming_the_check(capsys: pytest.CaptureFixture[str]) -> None:
    """Found by review: a server stopped during a run had every later check fail with UNAVAILABLE,
    blamed on a dozen rules (exit 1). The run stops at the first check failed against a target that
    no longer answers, and names it (exit 2)."""
    server, address, engine = _toy_with(Control)
    checks = select(["D1", "D3", "G1"])  # D3 and G1 call the target (D2 may judge what discovery saw)

    def stop_after_the_first(result: Any) -> None:
        if result.name == checks[0].name:
            _stop(server, engine)

    try:
        with pytest.raises(ConnectError, match=f"UNAVAILABLE. during check {checks[1].name} .check 2 of the run"
                           ) as lost:
            run_report(address, checks, Options(rpc_timeout_s=5.0), on_result=stop_after_the_first)
    finally:
        _stop(server, engine)
    # The verdicts before it are kept: the first check's, not the one the target went away in.
    assert isinstance(lost.value, TargetLost) and lost.value.report.stopped == str(lost.value)
    assert [(r.name, r.status) for r in lost.value.report.results] == [(checks[0].name, Status.PASS)]


def test_a_run_whose_target_goes_away_still_reports_the_checks_before(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """The command line prints and writes (--json) the report of the checks before the one the
    target went away in, its "stopped" naming that check, and exits 2. Before, it printed nothing
    but the error, and wrote no report."""
    server, address, engine = _toy_with(Control)
    first = select(["D1"])[0].name

    def stopping_after_the_first(*args: Any, on_result: Any = None, **kwargs: Any) -> Any:
        def hook(result: Any) -> None:
            on_result(result)
            if result.name == first:
                _stop(server, engine)
        return run_report(*args, on_result=hook, **kwargs)

    monkeypatch.setattr(command, "run_report", stopping_after_the_first)
    out = tmp_path / "report.json"
    try:
        code, err = _main(capsys, "--target", address, "--rules", "D1,D3,G1", "--rpc-timeout", "5",
                          "--json", str(out))
    finally:
        _stop(server, engine)
    data = json.loads(out.read_text())
    assert code == 2 and "stopped answering (UNAVAILABLE) during check" in err, err
    assert [r["check"] for r in data["results"]] == [first] and data["results"][0]["status"] == "pass"
    assert "stopped answering" in data["stopped"] and data["stopped"] in err


def test_a_background_stream_waits_its_own_deadline(capsys: pytest.CaptureFixture[str]) -> None:
    """Found by review: a background Generate was joined for a fixed 120 s, which cut off a stream
    a longer --timeout allowed. The join now waits the stream's deadline and a margin; a call still
    running after its join timeout fails the check, saying so."""
    server, address, engine = _toy_with(Control)
    try:
        with Target(address, Options(stream_timeout_s=500.0, rpc_timeout_s=5.0)) as target:
            request = target.request("bg", max_tokens=2)
            assert target.generate_async(request).join_timeout == 500.0 + BACKGROUND_JOIN_MARGIN_S
            assert target.generate_async(request, timeout=7.0).join_timeout == 7.0 + BACKGROUND_JOIN_MARGIN_S
    finally:
        _stop(server, engine)
    with pytest.raises(CheckFailed, match="did not end within 0 s"):
        Background(lambda: time.sleep(0.5), join_timeout=0.05).join()
