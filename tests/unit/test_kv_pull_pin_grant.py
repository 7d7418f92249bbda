"""The prefill side's Pin (refengine.kvpull.v1): it grants at most its own --kv-pull-timeout,
whatever the reader asks, and says what it granted (SessionReply.pinned_seconds), so that a reader
asking longer does not trust a READ that outlasts the pin (K10; found by review)."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace
from typing import Any

import pytest

from refengine.protocol.kvpull.v1 import kv_pull_pb2 as pb
from refengine.server.kv_pull_service import KvPullServicer

BOUND_SECONDS = 30.0  # the prefill server's --kv-pull-timeout


class _Engine:
    info = SimpleNamespace(role="prefill")

    def __init__(self) -> None:
        self.pins: list[float] = []

    def kv_session_content(self, session_id: str) -> str:
        return "prompt 00"

    def pin_kv_session(self, session_id: str, seconds: float, expected_content: str) -> tuple[int, ...]:
        self.pins.append(seconds)
        return (4, 5)

    def kv_read_identity(self) -> str:
        return ""


class _Context:
    async def send_initial_metadata(self, metadata: Any) -> None:
        self.metadata = metadata


@pytest.mark.parametrize("asked,granted", [(2.0, 2.0), (1e6, BOUND_SECONDS), (math.inf, BOUND_SECONDS)])
def test_a_pin_grants_at_most_the_bound_and_says_so(asked: float, granted: float) -> None:
    engine = _Engine()
    state = SimpleNamespace(engine=engine, engine_for_control=lambda: engine, engine_config=SimpleNamespace(
        kv_transfer=SimpleNamespace(pull_timeout_seconds=BOUND_SECONDS)))
    reply = asyncio.run(KvPullServicer(state).Pin(pb.PinRequest(session_id="s", seconds=asked), _Context()))
    assert engine.pins == [granted] and reply.pinned_seconds == granted and reply.num_blocks == 2
