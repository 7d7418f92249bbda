"""``refengine conformance`` as a product, against the toy server: profiles and their claims,
the three report formats (the JSON one field by field), evidence of a failure, load mode."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent import futures
from typing import Any

import grpc

from refengine.conformance import Options, Status, render, run_report, select
from refengine.conformance.load import LoadOptions, run_load
from refengine.conformance.profiles import BY_NAME, checks_of
from refengine.conformance.report import to_dict
from refengine.protocol import oe
from tests.conformance.fake_server import Control, Faults, Inference, serve
from tests.conformance.test_conformance import REPO
from tests.conformance.toy_engine import ToyEngine

RESULT_KEYS = {"rule", "check", "title", "profile", "status", "message", "evidence"}



def _cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "refengine.cli", "conformance", *args, "--quiet"], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_claims_of_the_toy(toy_address: str) -> None:
    """The toy claims core, load, logprobs, multi-sequence and guided; not LoRA (supports_lora =
    false), KV events (UNIMPLEMENTED), roles it is not, media, or the draft profile."""
    report = run_report(toy_address, select(["D1"]))
    claimed = {p.name: p.claimed for p in report.profiles}
    assert claimed == {"core": True, "load": True, "logprobs": True, "multi-sequence": True, "guided": True,
                       "lora": False, "kv-events": False, "prefix-cache": True, "prefill": False, "decode": False,
                       "multimodal": False, "encoder": False}
    why = {p.name: p.why for p in report.profiles}
    assert why["lora"] == "supports_lora = false" and "UNIMPLEMENTED" in why["kv-events"]
    assert "--prefill" in why["prefill"] and "max_num_sequences = 4" == why["multi-sequence"]


def test_unclaimed_profile_checks_do_not_run(toy_address: str) -> None:
    report = run_report(toy_address, checks_of(["lora", "kv-events"]))
    assert report.results and all(r.status is Status.NOT_CLAIMED for r in report.results)
    assert all(r.message.startswith(f"profile {r.profile} not claimed: ") for r in report.results)
    assert all(r.seconds < 0.05 for r in report.results)  # not run: nothing was sent


def test_json_report_is_the_documented_shape(toy_address: str, tmp_path) -> None:  # noqa: ANN001
    out = tmp_path / "report.json"
    proc = _cli("--target", toy_address, "--profile", "core", "--profile", "lora", "--rules", "D,A1,R",
                "--format", "json", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data == json.loads(out.read_text())
    assert set(data) == {"target", "server", "profiles", "rules", "results", "load", "stopped"}
    assert data["load"] is None and data["stopped"] is None
    assert data["target"] == toy_address and data["server"]["engine_name"] == "toy"
    assert data["server"]["engine_role"] == "ENGINE_ROLE_AGGREGATED" and data["server"]["schema_revision"] == 1
    assert [p["name"] for p in data["profiles"]] == list(BY_NAME)
    statuses = {p["name"]: p["status"] for p in data["profiles"]}
    assert statuses["core"] == "pass" and statuses["lora"] == "not_claimed"
    assert all(set(r) == RESULT_KEYS for r in data["results"])
    assert {r["profile"] for r in data["results"]} == {"core", "lora"}  # --rules within --profile
    assert {r["rule"][0] for r in data["results"]} <= {"D", "A", "R"}
    assert {r["status"] for r in data["results"] if r["profile"] == "lora"} == {"not_claimed"}
    assert {(x["rule"], x["status"]) for x in data["rules"]} >= {("A1", "pass"), ("R1", "not_claimed")}


def test_the_same_run_gives_the_same_statuses(toy_address: str) -> None:
    """Determinism: two runs of the same checks agree on every status."""
    checks = select(["D", "G1", "G4", "G10", "G12", "A"])
    first, second = (to_dict(run_report(toy_address, checks)) for _ in range(2))
    assert [(r["check"], r["status"]) for r in first["results"]] == \
        [(r["check"], r["status"]) for r in second["results"]]
    assert first["profiles"] == second["profiles"]


def test_failure_carries_its_evidence() -> None:
    server, address, engine = serve(Faults(leak_stop=True))
    try:
        report = run_report(address, select(["G14"]))
    finally:
        server.stop(0)
        engine.running = False
    failed = [r for r in report.results if r.status is Status.FAIL]
    assert [r.name for r in failed] == ["G14:stop_string_held_back"]
    evidence = failed[0].evidence
    assert 1 <= len(evidence) <= 3 and evidence[-1]["rpc"] == "Generate"
    assert evidence[-1]["request"]["stopping"]["conditions"][0]["stop_text"]  # the request sent: a stop string
    assert any("token" in e for e in evidence[-1]["events"])  # what came back
    text = render(report, "text")
    assert "[fail] profile core" in text and "evidence:" in text
    assert "| G14 | fail |" in render(report, "markdown")


def test_bad_command_lines(toy_address: str) -> None:
    assert _cli("--profile", "core").returncode == 2  # no target
    proc = _cli("--target", toy_address, "--rules", "Z9")
    assert proc.returncode == 2 and "no check for: Z9" in proc.stderr
    proc = _cli("--target", toy_address, "--profile", "nope")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_load_mode_passes_a_conforming_server(toy_address: str) -> None:
    report = run_report(toy_address, [])
    loaded = run_load(report, toy_address, Options(idle_timeout_s=5.0), LoadOptions(4, 2.0, seed=3))
    by_name = {r.name: r for r in loaded.results}
    assert set(by_name) == {"X1:load_malformed_refused", "G12:load_streams_valid", "H4:load_idle_after"}
    assert all(r.status is Status.PASS and r.profile == "load" for r in by_name.values()), by_name
    outcomes = loaded.load["outcomes"]
    assert loaded.load["requests"] == sum(outcomes.values()) > 8
    assert {"ok", "cancelled", "aborted", "refused:INVALID_ARGUMENT"} <= set(outcomes), outcomes


def test_load_mode_from_the_cli(toy_address: str) -> None:
    proc = _cli("--target", toy_address, "--rules", "D1", "--load", "3", "--duration", "1.5", "--format", "json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["load"]["streams"] == 3 and data["load"]["requests"] > 0
    assert {r["check"] for r in data["results"] if r["profile"] == "load"} >= {"H4:load_idle_after"}


class _StuckLoad(Control):
    """A toy whose GetLoad always counts one running request: it never reports idle."""

    def GetLoad(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        load = super().GetLoad(request, context)
        load.running_requests += 1
        return load


def test_load_mode_catches_a_server_that_never_gets_idle() -> None:
    engine = ToyEngine(Faults())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    oe.add_InferenceServicer_to_server(Inference(engine), server)
    oe.add_ControlServicer_to_server(_StuckLoad(engine), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        report = run_load(run_report(address, []), address, Options(idle_timeout_s=1.0), LoadOptions(2, 1.0))
    finally:
        server.stop(0)
        engine.running = False
    by_name = {r.name: r for r in report.results}
    assert by_name["H4:load_idle_after"].status is Status.FAIL
    assert "running=1" in by_name["H4:load_idle_after"].message
    # a short run may send no malformed request: then X1 skips (it passed on nothing before, found by review)
    assert by_name["X1:load_malformed_refused"].status in (Status.PASS, Status.SKIP)
