"""Runs checks against one server and renders the support matrix."""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import grpc

from refengine.conformance.registry import Check, CheckFailed, CheckSkipped, Status, rule_key, select
from refengine.conformance.target import Options, Target


@dataclass(frozen=True)
class Result:
    """The outcome of one check."""

    rule: str
    section: str
    title: str
    name: str
    status: Status
    message: str
    seconds: float

    def as_dict(self) -> dict:
        d = asdict(self)
        d["status"] = self.status.value
        return d


def run_check(check: Check, target: Target) -> Result:
    """Run one check; every exception becomes FAIL with its message, never a crash."""
    start = time.perf_counter()
    try:
        note = check.fn(target)
        status, message = Status.PASS, note or ""
    except CheckSkipped as exc:
        status, message = Status.SKIP, str(exc)
    except CheckFailed as exc:
        status, message = Status.FAIL, str(exc)
    except grpc.RpcError as exc:
        status, message = Status.FAIL, f"unexpected gRPC status {exc.code().name}: {exc.details()}"
    except Exception as exc:  # noqa: BLE001 - a broken check or server must not stop the run
        where = traceback.extract_tb(exc.__traceback__)[-1]
        status, message = Status.FAIL, f"{type(exc).__name__}: {exc} (at {where.name}:{where.lineno})"
    return Result(check.rule, check.section, check.title, check.name, status, message,
                  time.perf_counter() - start)


def run(address: str, rules: Iterable[str] | None = None, options: Options | None = None,
        on_result: Callable[[Result], None] | None = None) -> list[Result]:
    """Connect to ``address``, run the selected checks in RULES.md order, return results."""
    checks = select(list(rules) if rules else None)
    results = []
    with Target(address, options) as target:
        for chk in checks:
            result = run_check(chk, target)
            results.append(result)
            if on_result is not None:
                on_result(result)
    return results


def format_matrix(results: list[Result], width: int = 110) -> str:
    """A markdown table: rule, section, title, status, message (truncated to ``width``)."""
    rows = ["| rule | section | check | status | message |", "|---|---|---|---|---|"]
    for r in results:
        message = r.message.replace("|", "\\|").replace("\n", " ")
        if len(message) > width:
            message = message[: width - 1] + "…"
        rows.append(f"| {r.rule} | {r.section} | {r.title} | {r.status.value} | {message} |")
    counts = {s: sum(1 for r in results if r.status is s) for s in Status}
    rules = {r.rule for r in results}
    failed_rules = sorted({r.rule for r in results if r.status is Status.FAIL}, key=rule_key)
    rows.append("")
    rows.append(f"{len(results)} checks over {len(rules)} rules: {counts[Status.PASS]} PASS, "
                f"{counts[Status.FAIL]} FAIL, {counts[Status.SKIP]} SKIP"
                + (f"; failing rules: {', '.join(failed_rules)}" if failed_rules else ""))
    return "\n".join(rows)


def to_json(results: list[Result], address: str) -> str:
    return json.dumps({"target": address, "results": [r.as_dict() for r in results]}, indent=2)
