"""A run's report in three forms: text (a terminal), markdown (docs), JSON (machines).

The JSON form is stable (docs/conformance.md)::

    {"target": "HOST:PORT",
     "server": {"engine_name", "engine_version", "engine_role", "schema_revision",
                "schema_release", "supported_models", "model", "model_id"},
     "profiles": [{"name", "title", "draft", "claimed", "why", "status"}],
     "rules": [{"rule", "status"}],
     "results": [{"rule", "check", "title", "profile", "status", "message", "evidence"}],
     "load": null | {"streams", "duration_s", "seed", "requests", "outcomes": {kind: count}},
     "stopped": null | "why the run ended before its last check"}

``status`` is one of ``pass``, ``fail``, ``not_claimed``, ``skipped``; a profile's status is
``fail`` when any of its checks failed, else ``not_claimed`` (unclaimed), else ``pass`` when one
of its checks passed, else ``skipped`` (none ran, or all skipped); a rule's is the worst
of its checks' (fail, then pass, then skipped, then not_claimed). A run whose target stopped
answering ends there (exit 2): its report holds the checks before that one, and ``stopped`` says
so. ``evidence`` is empty unless
the check failed: then the last exchanges it had with the server (request, status, events).
No status depends on timing, so two runs against the same server give equal statuses; a
message may quote a time it measured (A5's), and differ.
"""

from __future__ import annotations

import json
from typing import Any

from refengine.conformance.registry import Status, rule_key
from refengine.conformance.runner import Report, Result

#: A rule's status is the first of these that any of its checks has.
RULE_ORDER = (Status.FAIL, Status.PASS, Status.SKIP, Status.NOT_CLAIMED)
FORMATS = ("text", "markdown", "json")


def rule_statuses(results: list[Result]) -> dict[str, Status]:
    """Each rule id (in RULES.md order) and the status of its checks together."""
    by_rule: dict[str, set[Status]] = {}
    for r in results:
        by_rule.setdefault(r.rule, set()).add(r.status)
    return {rule: next(s for s in RULE_ORDER if s in by_rule[rule]) for rule in sorted(by_rule, key=rule_key)}


def summary(results: list[Result]) -> str:
    counts = {s: sum(1 for r in results if r.status is s) for s in Status}
    failed = [rule for rule, s in rule_statuses(results).items() if s is Status.FAIL]
    return (f"{len(results)} checks over {len({r.rule for r in results})} rules: {counts[Status.PASS]} pass, "
            f"{counts[Status.FAIL]} fail, {counts[Status.NOT_CLAIMED]} not claimed, {counts[Status.SKIP]} skipped"
            + (f"; failing rules: {', '.join(failed)}" if failed else ""))


def _one_line(text: str, width: int) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= width else text[: width - 1] + "…"


def to_text(report: Report, width: int = 100) -> str:
    lines = [f"target {report.target}: {report.server['engine_name']} {report.server['engine_version']}, "
             f"{report.server['engine_role']}, model {report.server['model']}"]
    for claim in report.profiles:
        mine = [r for r in report.results if r.profile == claim.name]
        if not mine:
            continue
        status = report.profile_status(claim.name).value
        lines.append(f"\n[{status}] profile {claim.name}{' (draft)' if claim.draft else ''}: {claim.why}")
        lines += [f"  {r.status.value:11} {r.name:45} {_one_line(r.message, width)}" for r in mine]
        lines += [f"      evidence: {_one_line(json.dumps(e), 4 * width)}" for r in mine for e in r.evidence]
    if report.load is not None:
        lines.append(f"\nload: {report.load['requests']} requests from {report.load['streams']} streams in "
                     f"{report.load['duration_s']:g} s; outcomes {json.dumps(report.load['outcomes'])}")
    lines.append("\n" + summary(report.results))
    lines += [f"stopped early: {report.stopped}"] if report.stopped else []
    return "\n".join(lines)


def _cell(text: str, width: int) -> str:
    return _one_line(text, width).replace("|", "\\|")


def to_markdown(report: Report, width: int = 110, messages: bool = True) -> str:
    """A table of profiles, then one of rules, then one per profile of its checks."""
    out = ["| profile | claimed | status | why |", "|---|---|---|---|"]
    out += [f"| {p.name}{' (draft)' if p.draft else ''} | {'yes' if p.claimed else 'no'} | "
            f"{report.profile_status(p.name).value} | {_cell(p.why, width)} |" for p in report.profiles]
    out += ["", "| rule | status |", "|---|---|"]
    out += [f"| {rule} | {status.value} |" for rule, status in rule_statuses(report.results).items()]
    for claim in report.profiles:
        mine = [r for r in report.results if r.profile == claim.name]
        if not mine:
            continue
        out += ["", f"**{claim.name}**", "", "| rule | check | status |" + (" message |" if messages else ""),
                "|---|---|---|" + ("---|" if messages else "")]
        out += [f"| {r.rule} | {_cell(r.title, width)} | {r.status.value} |"
                + (f" {_cell(r.message, width)} |" if messages else "") for r in mine]
    out += ["", summary(report.results)]
    out += ["", f"**Stopped early:** {_cell(report.stopped, 4 * width)}"] if report.stopped else []
    return "\n".join(out)


def to_dict(report: Report) -> dict[str, Any]:
    return {
        "target": report.target,
        "server": report.server,
        "profiles": [{"name": p.name, "title": p.title, "draft": p.draft, "claimed": p.claimed, "why": p.why,
                      "status": report.profile_status(p.name).value} for p in report.profiles],
        "rules": [{"rule": rule, "status": s.value} for rule, s in rule_statuses(report.results).items()],
        "results": [{"rule": r.rule, "check": r.name, "title": r.title, "profile": r.profile,
                     "status": r.status.value, "message": r.message, "evidence": r.evidence}
                    for r in report.results],
        "load": report.load,
        "stopped": report.stopped or None,
    }


def render(report: Report, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(to_dict(report), indent=2)
    if fmt == "markdown":
        return to_markdown(report)
    if fmt == "text":
        return to_text(report)
    raise ValueError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")


def format_matrix(results: list[Result], width: int = 110) -> str:
    """A flat markdown table of results (rule, section, check, status, message) and the summary."""
    rows = ["| rule | section | check | status | message |", "|---|---|---|---|---|"]
    rows += [f"| {r.rule} | {r.section} | {_cell(r.title, width)} | {r.status.value} | {_cell(r.message, width)} |"
             for r in results]
    return "\n".join([*rows, "", summary(results)])
