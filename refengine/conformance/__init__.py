"""OpenEngine v0.1.0 conformance suite.

v0.1.0 means the release: signed tag ``v0.1.0`` = commit b5f2bd9, Buf module
``buf.build/openengine/openengine`` at the immutable commit 768a93c7b44e40f28c692ad0b471a8f2
(schema revision 1; see :mod:`refengine.conformance.release`), not the earlier
pre-release copy 4def7c5.

Points at any OpenEngine server (``host:port``), runs one or more checks per rule
of ``contract/RULES.md`` through the generated gRPC stubs only, and reports a
support matrix: PASS, FAIL (observed vs expected) or SKIP (feature not
advertised). Usage::

    python -m refengine.conformance 127.0.0.1:50051 [--rules G1,G14,L] [--json out.json]

Draft profiles (docs/profiles/) have checks too, in sections of their own: ``ENC`` for the
encoder profile (ENC1–ENC15), which need an encoder server (``--encoder HOST:PORT``, or the
target itself) and, for the consumer side, ``--media-placeholder-token-id N``; against servers
that do not list the profile in ``ServerInfo.extra["refengine.profiles"]`` they skip as "not
claimed"::

    python -m refengine.conformance AGG:PORT --rules ENC --encoder ENC:PORT --media-placeholder-token-id N

or from Python::

    from refengine.conformance import run
    results = run("127.0.0.1:50051", rules=["G"])
"""

from refengine.conformance.registry import Check, Status, all_checks, check, select
from refengine.conformance.runner import Result, format_matrix, run, run_check
from refengine.conformance.target import Options, Target

__all__ = ["Check", "Options", "Result", "Status", "Target", "all_checks", "check", "format_matrix", "run",
           "run_check", "select"]
