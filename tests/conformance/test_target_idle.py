"""``Target.wait_idle`` against a server that leaked KV blocks (refengine/conformance/target.py).

The leak is reported by the check that meets it (a skip naming the idle rules for another
rule's check, a failure for an idle rule's), and that check raises the idle value to what
the server holds, so a later check does not wait out the idle timeout again. Load replies are
scripted: no server is needed to hold the rule.
"""

from __future__ import annotations

import time

import pytest

from refengine.conformance.registry import CheckFailed, CheckSkipped
from refengine.conformance.target import Options, Target
from refengine.protocol import oe

IDLE_TIMEOUT_S = 0.3


def target_holding(used_kv_blocks: list[int], running: int = 0) -> Target:
    """A target whose GetLoad replies report ``used_kv_blocks`` in turn (the last one repeats)."""
    target = Target("127.0.0.1:1", Options(idle_timeout_s=IDLE_TIMEOUT_S))
    replies = list(used_kv_blocks)

    def load(per_rank: bool = False) -> oe.LoadInfo:
        used = replies.pop(0) if len(replies) > 1 else replies[0]
        return oe.LoadInfo(running_requests=running, queued_requests=0, used_kv_blocks=used)

    target.load = load  # type: ignore[method-assign]
    target.idle_used_kv_blocks = 0
    return target


def timed(call) -> float:  # noqa: ANN001
    start = time.monotonic()
    call()
    return time.monotonic() - start


@pytest.mark.parametrize(("rule", "raised"), [("G1", CheckSkipped), ("A5", CheckFailed)])
def test_a_leak_is_reported_once_then_becomes_the_idle_value(rule: str, raised: type[Exception]) -> None:
    target = target_holding([3])
    target.rule = rule
    with pytest.raises(raised, match="used_kv_blocks=3 .*later checks take 3 as the idle value"):
        target.wait_idle("first")
    assert target.idle_used_kv_blocks == 3
    target.rule = "G2"
    assert timed(lambda: target.wait_idle("second")) < IDLE_TIMEOUT_S / 2, "the next check waited again"


def test_blocks_still_held_by_running_work_are_not_taken_as_idle() -> None:
    """Work still running is not a leak: the idle value stays where it was."""
    target = target_holding([3], running=1)
    target.rule = "G1"
    with pytest.raises(CheckSkipped):
        target.wait_idle("busy")
    assert target.idle_used_kv_blocks == 0


def test_a_server_that_frees_its_blocks_in_time_is_idle() -> None:
    target = target_holding([3, 2, 0])
    assert target.wait_idle("frees").used_kv_blocks == 0
    assert target.idle_used_kv_blocks == 0
