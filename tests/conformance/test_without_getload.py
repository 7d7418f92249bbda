"""GetLoad is optional outside the load profile: the abort checks still judge what they can see
without it (found by review: A3, made a release rule, skipped on such a server, where it had
passed before)."""

from __future__ import annotations

import grpc
import pytest

from refengine.conformance import Options, Status, run
from tests.conformance import fake_server
from tests.conformance import toy_kv_events as toy
from tests.conformance.toy_faults import Faults


def _no_get_load(self, request, context):  # noqa: ANN001, ANN202 - a servicer method
    context.abort(grpc.StatusCode.UNIMPLEMENTED, "no GetLoad here")


def test_abort_checks_pass_without_get_load(monkeypatch: pytest.MonkeyPatch) -> None:
    for servicer in [fake_server.Control] + [c for c in vars(toy).values()
                                             if isinstance(c, type) and issubclass(c, fake_server.Control)]:
        monkeypatch.setattr(servicer, "GetLoad", _no_get_load)
    server, address, engine = toy.serve_kv(toy.KvFaults(), Faults())
    try:
        results = {r.name: r for r in run(address, ["A3", "A4"], Options(idle_timeout_s=3.0))}
    finally:
        server.stop(0)
        engine.running = False
    assert results["A3:abort_all"].status is Status.PASS, results["A3:abort_all"].message
    assert "not observed" in results["A3:abort_all"].message
    assert results["A4:abort_running"].status is Status.PASS, results["A4:abort_running"].message
