"""The stream bridge's bound on the memory of undelivered outputs (``buffer_bytes``): the stall
clock starts when their estimated size reaches it, as when their number reaches ``capacity``;
past ``OVERFLOW_FACTOR`` times it ``on_stall`` runs at once, with ``outrun`` set; what the
consumer takes no longer counts. Found by review: a client asking for all-vocabulary candidates
grew the server by 2.5 GB within one stall timeout."""

from __future__ import annotations

import asyncio

from refengine.server.stream_bridge import (
    CANDIDATE_BYTES,
    OUTPUT_BYTES,
    OVERFLOW_FACTOR,
    TOKEN_BYTES,
    OutputBridge,
    held_bytes,
)
from refengine.types import Candidate, RequestOutput, SequenceDelta, TokenInfo

NUM_CANDIDATES = 50
ONE = OUTPUT_BYTES + TOKEN_BYTES + NUM_CANDIDATES * CANDIDATE_BYTES  # one output of one token


def output(num_candidates: int = NUM_CANDIDATES) -> RequestOutput:
    candidates = tuple(Candidate(i, -1.0, i + 1, "x") for i in range(num_candidates))
    return RequestOutput("r", deltas=(SequenceDelta(0, (TokenInfo(7, "x", -1.0, 1, candidates),), "x"),))


def test_the_estimate_counts_tokens_and_candidates_of_outputs_and_prompt() -> None:
    assert held_bytes(output()) == ONE
    prompt = (TokenInfo(1, "a"), TokenInfo(2, "b", -0.5, 1, (Candidate(2, -0.5, 1, "b"),)))
    assert held_bytes(RequestOutput("r", prompt_tokens=prompt)) == OUTPUT_BYTES + 2 * TOKEN_BYTES + CANDIDATE_BYTES


def run(buffer_bytes: int, pushes: int, take: int = 0, wait: float = 0.15) -> list[bool]:
    """Push ``pushes`` outputs (capacity 64 outputs: never the bound here), let the consumer take
    ``take`` of them, wait; returns ``outrun`` at each ``on_stall``."""
    async def scenario() -> list[bool]:
        stalls: list[bool] = []
        bridge = OutputBridge(asyncio.get_running_loop(), "r", 64, 0.05, lambda b: stalls.append(b.outrun),
                              buffer_bytes=buffer_bytes)
        for _ in range(pushes):
            bridge.sink(output())
        await asyncio.sleep(0)  # the pushes run on the loop
        for _ in range(take):
            await bridge.next()
        await asyncio.sleep(wait)
        return stalls

    return asyncio.run(scenario())


def test_below_the_bound_nothing_happens() -> None:
    assert run(buffer_bytes=3 * ONE, pushes=2) == []


def test_at_the_bound_the_stall_clock_runs_out() -> None:
    assert run(buffer_bytes=3 * ONE, pushes=3) == [False]


def test_taken_outputs_no_longer_count() -> None:
    assert run(buffer_bytes=3 * ONE, pushes=4, take=2) == []


def test_past_the_overflow_on_stall_runs_at_once_and_once() -> None:
    """No wait for the stall timeout (0.05 s): none at all here; and once, however many follow."""
    assert run(buffer_bytes=2 * ONE, pushes=2 * OVERFLOW_FACTOR + 5, wait=0) == [True]


def test_one_output_larger_than_the_overflow_is_delivered() -> None:
    """What waits behind the next output counts, not the next one: a single output the request
    asked for (all candidates over a large vocabulary) is no client falling behind."""
    async def scenario() -> tuple[list[bool], bool]:
        stalls: list[bool] = []
        bridge = OutputBridge(asyncio.get_running_loop(), "r", 64, 0.05, lambda b: stalls.append(b.outrun),
                              buffer_bytes=ONE // 8)
        bridge.sink(output())
        bridge.sink(RequestOutput("r", finished=True))
        await asyncio.sleep(0)
        first, last = await bridge.next(), await bridge.next()
        return stalls, first.error is None and last.finished and last.error is None

    assert asyncio.run(scenario()) == ([], True)


def test_without_a_byte_bound_only_the_number_counts() -> None:
    async def scenario() -> list[bool]:
        stalls: list[bool] = []
        bridge = OutputBridge(asyncio.get_running_loop(), "r", 64, 0.05, lambda b: stalls.append(b.outrun))
        for _ in range(63):
            bridge.sink(output(num_candidates=10_000))
        await asyncio.sleep(0.15)
        return stalls

    assert asyncio.run(scenario()) == []
