"""After a failed check, the runner asks whether the target went away during it (``_gone_during``):
a target whose GetServerInfo answers UNAVAILABLE did, and so did one still answering Control while
its Health says NOT_READY, as a draining server does (found by review: a server sent SIGTERM mid-run
got eleven FAILs, one per check, each for a Generate refused UNAVAILABLE 'the server is draining',
before the run stopped at a check whose GetServerInfo failed). A NOT_READY reply names what is not
ready; a READY or DEGRADED target did not go away."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from refengine.conformance.registry import select
from refengine.conformance.runner import _gone_during
from refengine.protocol import oe

CHECK = select(["G1"])[0]


class _Answers:
    """The two Control replies ``_gone_during`` reads."""

    address = "127.0.0.1:1"

    def __init__(self, info_code: grpc.StatusCode, health: Any) -> None:
        self.info_code, self.health = info_code, health

    def unary_code(self, method: str, request: Any) -> tuple[grpc.StatusCode, Any]:
        if method == "GetServerInfo":
            return self.info_code, oe.ServerInfo() if self.info_code == grpc.StatusCode.OK else None
        assert method == "Health", method
        return grpc.StatusCode.OK, self.health


def _health(state: int, message: str = "") -> oe.HealthResponse:
    return oe.HealthResponse(state=state, checks=[oe.HealthCheck(name="scheduler", state=state, message=message)])


def test_a_draining_target_went_away() -> None:
    said = _gone_during(_Answers(grpc.StatusCode.OK, _health(oe.HEALTH_STATE_NOT_READY, "draining: shutting down")),
                        CHECK, 12)
    assert said.startswith("127.0.0.1:1 stopped serving (Health NOT_READY: scheduler: draining: shutting down) "
                           f"during check {CHECK.name} (check 12 of the run)"), said


def test_an_unavailable_target_went_away() -> None:
    said = _gone_during(_Answers(grpc.StatusCode.UNAVAILABLE, None), CHECK, 3)
    assert "stopped answering (UNAVAILABLE) during check" in said, said


@pytest.mark.parametrize("state", [oe.HEALTH_STATE_READY, oe.HEALTH_STATE_DEGRADED])
def test_a_serving_target_did_not(state: int) -> None:
    assert _gone_during(_Answers(grpc.StatusCode.OK, _health(state)), CHECK, 3) == ""
