"""OpenEngine v0.1.0 conformance suite.

v0.1.0 means the release: signed tag ``v0.1.0`` = commit b5f2bd9, Buf module
``buf.build/openengine/openengine`` at the immutable commit 768a93c7b44e40f28c692ad0b471a8f2
(schema revision 1; see :mod:`refengine.conformance.release`), not the earlier
pre-release copy 4def7c5.

Points at any OpenEngine server (``host:port``), runs one or more checks per rule
of ``tests/data/RULES.md`` (the contract's, copied) through the generated gRPC stubs only, and reports a
support matrix: pass, fail (observed vs expected, with the exchanges as evidence),
not_claimed (the server does not advertise the feature) or skipped (the run lacks a named
target or an option the check needs). Each check belongs to one profile (:mod:`refengine.conformance.profiles`);
a profile the server does not claim reports its checks NOT_CLAIMED. Usage::

    refengine conformance --target 127.0.0.1:50051 [--profile guided] [--rules G1,G14,L]
                          [--format text|markdown|json] [--json out.json] [--load 8 --duration 10]

Draft profiles (docs/profiles/) have checks too, in sections of their own: ``ENC`` for the
encoder profile (ENC1–ENC15), which need an encoder server (``--encoder HOST:PORT``, or the
target itself) and, for the consumer side, ``--media-placeholder-token-id N``; against servers
that do not list the profile in ``ServerInfo.extra["refengine.profiles"]`` they skip as "not
claimed"::

    refengine conformance --target AGG:PORT --profile encoder --encoder ENC:PORT --media-placeholder-token-id N

or from Python::

    from refengine.conformance import format_matrix, run
    results = run("127.0.0.1:50051", rules=["G"])
    print(format_matrix(results))  # a markdown table (rule, section, check, status, message), then a summary
"""

from refengine.conformance.registry import Check, Status, all_checks, check, select
from refengine.conformance.report import format_matrix, render
from refengine.conformance.runner import Report, Result, run, run_check, run_report
from refengine.conformance.target import Options, Target

__all__ = ["Check", "Options", "Report", "Result", "Status", "Target", "all_checks", "check", "format_matrix",
           "render", "run", "run_check", "run_report", "select"]
