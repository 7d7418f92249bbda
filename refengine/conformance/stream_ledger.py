"""The run-wide record of structural problems (G9–G12, G16) in the streams that other checks
read.

Each check owns only its rule (see :mod:`assertions`): a stop-string check that reads a stream
with two GenerationFinished events skips ("the output cannot be read"), it does not fail G12.
Without this record a server that breaks G12, say, only on stop-string, logprob or aborted
streams would pass G12, whose own checks read plain streams. So every complete (status OK)
stream a check judges leaves here the structural problems that are not its own rule's, and the
run-wide checks (:mod:`checks_structure`, run last) report them under their rules.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from refengine.conformance.streams import StreamResult

#: The structural rules every accepted Generate stream is held to, whichever check sent it.
STRUCTURAL_RULES = ("G9", "G10", "G11", "G12", "G16")


@dataclass(frozen=True)
class Finding:
    """One structural problem: the rule it breaks, the check that read the stream, the request."""

    rule: str
    check: str
    request_id: str
    problem: str  # without its "G12: " prefix


class StreamLedger:
    """Structural findings of the run, and how many streams each rule saw through other checks.

    A stream is recorded once, however many times it is judged (a cached reference stream is
    read by several checks); checks on background threads record too, hence the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rules_of_streams: list[str] = []  # the owning rule of each stream recorded
        self._findings: list[Finding] = []

    def record(self, res: StreamResult, problems: list[str]) -> None:
        """Keep the structural problems of ``res`` that its own rule's check does not judge."""
        if not res.ok:  # a cut or failed stream is judged by its own check (X1, A4, A5)
            return
        with self._lock:
            if res.recorded:
                return
            res.recorded = True  # a flag, not a set of the results: they stay free to go
            self._rules_of_streams.append(res.rule)
            for problem in problems:
                rule, _, text = problem.partition(": ")
                if rule in STRUCTURAL_RULES and rule != res.rule:
                    self._findings.append(Finding(rule, res.check, res.request_id, text))

    def streams_for(self, rule: str) -> int:
        """How many recorded streams were read by checks of rules other than ``rule``."""
        with self._lock:
            return sum(1 for owner in self._rules_of_streams if owner != rule)

    def findings_for(self, rule: str) -> list[Finding]:
        with self._lock:
            return [f for f in self._findings if f.rule == rule]
