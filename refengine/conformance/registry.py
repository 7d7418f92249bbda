"""The check registry: every conformance check names the rule it checks.

A check is a plain function ``fn(target) -> str | None`` registered with
:func:`check`. It talks to the server only through ``target`` (generated gRPC
stubs on one channel) and ends in one of three ways:

- returns (``None`` or a note) -> PASS,
- raises :class:`CheckFailed` (``fail(...)``) -> FAIL, with what was observed
  versus what the rule expects,
- raises :class:`CheckNotClaimed` (``not_claimed(...)``) -> NOT_CLAIMED, when the server
  does not advertise the feature the check needs (the reason says which capability),
- raises :class:`CheckSkipped` (``skip(...)``) -> SKIPPED, when the feature is claimed but the
  run cannot observe it (a named target or an option is missing; the reason says which).

Any other exception is reported as FAIL too (an unexpected gRPC status, a
timeout): a conformance check never crashes the run.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from refengine.conformance.target import Target

#: Sections of RULES.md, in document order, then those of the draft profiles (docs/profiles/).
SECTIONS: dict[str, str] = {
    "D": "discovery",
    "M": "request metadata",
    "G": "Generate",
    "L": "logprobs and candidates",
    "K": "KV options, prefix cache, disaggregation",
    "A": "abort",
    "H": "health and load",
    "R": "LoRA lifecycle",
    "E": "KV events",
    "X": "errors",
    "ENC": "draft profile encoder",
}

_RULE_ID = re.compile(r"^([A-Z]+)(\d+)$")


class Status(enum.Enum):
    """A check's outcome; the values are the stable strings of the JSON report."""

    PASS = "pass"
    FAIL = "fail"
    NOT_CLAIMED = "not_claimed"
    SKIP = "skipped"


class CheckFailed(AssertionError):
    """The server did something the rule forbids (message: observed vs expected)."""


class CheckSkipped(Exception):
    """The check cannot run in this run (a named target or an option is missing)."""


class CheckNotClaimed(CheckSkipped):
    """The server does not advertise what the check needs: nothing to hold it to."""


def fail(message: str) -> None:
    raise CheckFailed(message)


def skip(reason: str) -> None:
    raise CheckSkipped(reason)


def not_claimed(reason: str) -> None:
    raise CheckNotClaimed(reason)


def expect(condition: bool, message: str) -> None:
    """Fail with ``message`` unless ``condition`` holds."""
    if not condition:
        raise CheckFailed(message)


CheckFn = Callable[["Target"], "str | None"]


@dataclass(frozen=True)
class Check:
    """One registered check. ``name`` is unique; several checks may share a rule."""

    rule: str
    title: str
    fn: CheckFn
    name: str
    run_last: bool = False  # a run-wide check judging what the other checks received

    @property
    def section(self) -> str:
        return rule_section(self.rule)

    @property
    def key(self) -> tuple[bool, int, int, str]:
        """Sort key: run-wide checks last, then section in :data:`SECTIONS` order, rule number,
        check name."""
        section, number = rule_key(self.rule)
        return (self.run_last, section, number, self.name)


_REGISTRY: dict[str, Check] = {}


def rule_section(rule: str) -> str:
    match = _RULE_ID.match(rule)
    if not match or match.group(1) not in SECTIONS:
        raise ValueError(f"not a rule id: {rule!r}")
    return match.group(1)


def rule_key(rule: str) -> tuple[int, int]:
    """(index of the rule's section in :data:`SECTIONS`, its number): ``ENC3`` sorts after ``X4``."""
    section = rule_section(rule)
    return list(SECTIONS).index(section), int(rule[len(section):])


def check(rule: str, title: str, run_last: bool = False) -> Callable[[CheckFn], CheckFn]:
    """Register ``fn`` as a check of ``rule`` (e.g. ``"G14"``, ``"ENC3"``) with a one-line title;
    ``run_last``: after every other check, whose streams it judges."""
    rule_section(rule)

    def register(fn: CheckFn) -> CheckFn:
        name = f"{rule}:{fn.__name__}"
        if name in _REGISTRY:
            raise ValueError(f"check {name} registered twice")
        _REGISTRY[name] = Check(rule=rule, title=title, fn=fn, name=name, run_last=run_last)
        return fn

    return register


def all_checks() -> list[Check]:
    """Every registered check, in RULES.md order. Importing the package loads them."""
    import refengine.conformance.checks  # noqa: F401  (registers every section)

    return sorted(_REGISTRY.values(), key=lambda c: c.key)


def select(rules: list[str] | None = None) -> list[Check]:
    """Checks whose rule id (``G14``) or section (``G``, ``ENC``) is in ``rules``; all when None."""
    checks = all_checks()
    if not rules:
        return checks
    wanted = {r.strip().upper() for r in rules if r.strip()}
    unknown = {w for w in wanted if w not in SECTIONS and not any(c.rule == w for c in checks)}
    if unknown:
        raise ValueError(f"no check for: {', '.join(sorted(unknown))}")
    return [c for c in checks if c.rule in wanted or c.section in wanted]
