"""Runs checks against one server: discovery, claims, each check, evidence of each failure."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc

from refengine.conformance.profiles import PROFILES, claims, profile_of
from refengine.conformance.registry import Check, CheckFailed, CheckNotClaimed, CheckSkipped, Status, select
from refengine.conformance.target import ConnectError, Options, Target
from refengine.protocol import oe


@dataclass(frozen=True)
class Result:
    """The outcome of one check. ``evidence``: the last exchanges of a failed check (else empty)."""

    rule: str
    section: str
    title: str
    name: str
    status: Status
    message: str
    seconds: float
    profile: str = ""
    evidence: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class ProfileClaim:
    name: str
    title: str
    draft: bool
    claimed: bool
    why: str


@dataclass(frozen=True)
class Report:
    """A whole run: the target, what it said about itself, its claims and every result."""

    target: str
    server: dict[str, Any]
    profiles: list[ProfileClaim]
    results: list[Result]
    load: dict[str, Any] | None = None  # the load mode's counts (outcomes by kind), when it ran
    stopped: str = ""  # why the run ended before its last check ("" when it ran them all)

    def profile_status(self, name: str) -> Status:
        """fail if any of its checks failed, else not_claimed when unclaimed, else pass when one of
        its checks passed, else skipped: a profile none of whose checks ran (or all skipped) has
        shown nothing."""
        mine = [r for r in self.results if r.profile == name]
        if any(r.status is Status.FAIL for r in mine):
            return Status.FAIL
        if not next(p for p in self.profiles if p.name == name).claimed:
            return Status.NOT_CLAIMED
        return Status.PASS if any(r.status is Status.PASS for r in mine) else Status.SKIP

    @property
    def failed(self) -> bool:
        return any(r.status is Status.FAIL for r in self.results)


def _outcome(check: Check, target: Target) -> tuple[Status, str]:
    try:
        note = check.fn(target)
        return Status.PASS, note or ""
    except CheckNotClaimed as exc:
        return Status.NOT_CLAIMED, str(exc)
    except CheckSkipped as exc:
        return Status.SKIP, str(exc)
    except CheckFailed as exc:
        return Status.FAIL, str(exc)
    except grpc.RpcError as exc:
        return Status.FAIL, f"unexpected gRPC status {exc.code().name}: {exc.details()}"
    except Exception as exc:  # noqa: BLE001 - a broken check or server must not stop the run
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return Status.FAIL, f"{type(exc).__name__}: {exc} (at {where.name}:{where.lineno})"


def run_check(check: Check, target: Target) -> Result:
    """Run one check; every exception becomes FAIL with its message, never a crash. A check
    of a profile the target does not claim is NOT_CLAIMED without running."""
    profile = profile_of(check)
    claimed, why = claims(target)[profile.name]
    start = time.perf_counter()
    evidence: list[dict[str, Any]] = []
    if not claimed:
        status, message = Status.NOT_CLAIMED, f"profile {profile.name} not claimed: {why}"
    else:
        target.rule, target.check = check.rule, check.name
        target.exchanges.clear()
        try:
            status, message = _outcome(check, target)
        finally:
            target.rule = target.check = ""
        if status is Status.FAIL:
            evidence = target.exchanges.render()
    return Result(check.rule, check.section, check.title, check.name, status, message,
                  time.perf_counter() - start, profile.name, evidence)


def server_facts(target: Target) -> dict[str, Any]:
    """The discovery facts a report states: who answered, what it serves, its revision."""
    info, model = target.server_info, target.model_info
    return {"engine_name": info.engine_name, "engine_version": info.engine_version,
            "engine_role": _role_name(info.engine_role),
            "schema_revision": info.schema_revision, "schema_release": info.schema_release,
            "supported_models": list(info.supported_models), "model": target.model,
            "model_id": model.model_id}


def _role_name(role: int) -> str:
    return oe.EngineRole.Name(role) if role in oe.EngineRole.values() else str(role)


def run_report(address: str, checks: Iterable[Check], options: Options | None = None,
               on_result: Callable[[Result], None] | None = None, core_run: bool = False) -> Report:
    """Connect to ``address`` and to every other server the options name (one that cannot be
    tested is a ConnectError naming its flag, before any check: found by review, a mistyped
    --decode failed every K check and K11 of the core profile), discover its claims, run
    ``checks`` in order. ``core_run``: the checks include the core profile's, not picked by rule:
    a target that does not generate (PREFILL, DECODE, an encoder) is a ConnectError then (found by
    review: a PREFILL target failed 38 checks of the core profile, which assumes AGGREGATED)."""
    with Target(address, options, (options or Options()).control_address) as target:
        role = target.server_info.engine_role
        if core_run and role != oe.ENGINE_ROLE_AGGREGATED:
            raise ConnectError(f"the target's engine_role is {_role_name(role)}, and the core profile checks a "
                               "server that generates (AGGREGATED): point --target at one and name this server "
                               "with --prefill/--decode (or --encoder), or pick its checks with --rules")
        for flag, named in (("--prefill", target.options.prefill_address), ("--decode", target.options.decode_address),
                            ("--encoder", target.options.encoder_address)):
            if named:
                _check_named(flag, Target(named, target.options))
        claimed = claims(target)
        profiles = [ProfileClaim(p.name, p.title, p.draft, *claimed[p.name]) for p in PROFILES]
        results = []
        for chk in checks:
            result = run_check(chk, target)
            results.append(result)
            if on_result is not None:
                on_result(result)
            if result.status is Status.FAIL and (lost := _gone_during(target, chk, len(results))):
                raise TargetLost(lost, Report(address, server_facts(target), profiles, results[:-1], stopped=lost))
        return Report(address, server_facts(target), profiles, results)


#: The engine_role a server named by each flag must report (an encoder is found by its draft profile).
NAMED_ROLES = {"--prefill": oe.ENGINE_ROLE_PREFILL, "--decode": oe.ENGINE_ROLE_DECODE}


def _check_named(flag: str, peer: Target) -> None:
    """A server named by ``flag`` answers discovery and has the flag's role, or the run cannot test
    it (ConnectError naming the flag). Found by review: an AGGREGATED server named as --prefill
    failed all nine K and M3 checks, exit 1, with no word on the flag."""
    try:
        peer.connect()
        role = peer.server_info.engine_role
        if flag in NAMED_ROLES and role != NAMED_ROLES[flag]:
            raise ConnectError(f"{peer.address} reports engine_role {_role_name(role)}, not "
                               f"{_role_name(NAMED_ROLES[flag])}")
    except ConnectError as err:
        raise ConnectError(f"{flag}: {err}") from None
    finally:
        peer.close()


class TargetLost(ConnectError):
    """The target stopped answering during a run. ``report`` holds the verdicts of the checks
    before the one it went away in, its ``stopped`` saying why the run ended there."""

    def __init__(self, message: str, report: Report) -> None:
        super().__init__(message)
        self.report = report


def _gone_during(target: Target, check: Check, num_run: int) -> str:
    """After a failed check: a target that no longer answers went away during it, and every later
    check would fail with UNAVAILABLE, blamed on its rule (found by review: a server stopped mid-run
    got 48 failures across a dozen rules, exit 1). Says so, naming the check; "" while it answers."""
    code, _ = target.unary_code("GetServerInfo", oe.GetServerInfoRequest())
    if code == grpc.StatusCode.UNAVAILABLE:
        why = "stopped answering (UNAVAILABLE)"
    else:  # a draining server still answers Control while it refuses new work (found by review: 11 false FAILs)
        code, health = target.unary_code("Health", oe.HealthRequest())
        if code != grpc.StatusCode.OK or health.state != oe.HEALTH_STATE_NOT_READY:
            return ""
        said = "; ".join(f"{c.name}: {c.message}" for c in health.checks if c.state == oe.HEALTH_STATE_NOT_READY)
        why = f"stopped serving (Health NOT_READY{': ' + said if said else ''})"
    return (f"{target.address} {why} during check {check.name} (check {num_run} of the run): no verdict on it or "
            "on the checks after it")


def run(address: str, rules: Iterable[str] | None = None, options: Options | None = None,
        on_result: Callable[[Result], None] | None = None) -> list[Result]:
    """Connect to ``address``, run the selected checks in RULES.md order, return results."""
    return run_report(address, select(list(rules) if rules else None), options, on_result).results
