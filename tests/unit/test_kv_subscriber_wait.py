"""The conformance KV subscriber's waits: a timeout counts from the last response that arrived,
so a stream still delivering (a conforming server whose events are late, on a loaded machine) is
not judged as missing what is awaited; a silent one is, after the timeout; and a stream that keeps
delivering without the awaited response is judged after STILL_ARRIVING timeouts. A wait given no
timeout lasts the run's ``Options.event_wait_s`` (``--event-wait``)."""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from refengine.conformance.command import add_arguments, options_from_args
from refengine.conformance.kv_subscriber import STILL_ARRIVING, KvSubscriber, subscribe
from refengine.conformance.options import EVENT_WAIT_S, Options
from refengine.protocol import oe


class PacedCall:
    """A SubscribeKvEvents call yielding a batch every ``pace`` seconds, ``count`` in all, then
    staying open (no status) until cancelled."""

    def __init__(self, count: int, pace: float) -> None:
        self.count, self.pace, self.cancelled = count, pace, threading.Event()

    def __iter__(self) -> Iterator[Any]:
        for number in range(1, self.count + 1):
            if self.cancelled.wait(self.pace):
                return
            yield oe.SubscribeKvEventsResponse(batch=oe.KvEventBatch(sequence_number=number))
        self.cancelled.wait()

    def code(self) -> None:
        return None

    def details(self) -> str:
        return ""

    def cancel(self) -> None:
        self.cancelled.set()


class PacedControl:
    def __init__(self, count: int, pace: float) -> None:
        self.call = PacedCall(count, pace)

    def SubscribeKvEvents(self, request: Any, timeout: float) -> PacedCall:  # noqa: N802
        return self.call


def _subscribe(count: int, pace: float) -> KvSubscriber:
    return KvSubscriber(PacedControl(count, pace), oe.SubscribeKvEventsRequest(), timeout=30)


def test_a_stream_still_delivering_is_waited_for_past_the_timeout() -> None:
    sub = _subscribe(count=6, pace=0.2)  # the 6th batch comes at ~1.2 s, past a 0.5 s timeout
    try:
        assert sub.wait_sequence(6, timeout=0.5)
    finally:
        sub.close()


def test_a_silent_stream_is_judged_after_the_timeout() -> None:
    sub = _subscribe(count=1, pace=0.05)
    try:
        assert sub.wait_sequence(1, timeout=2.0)
        started = time.monotonic()
        assert not sub.wait_sequence(2, timeout=0.4)
        assert 0.3 <= time.monotonic() - started < 1.5
    finally:
        sub.close()


def test_a_stream_delivering_other_batches_is_judged_after_still_arriving_timeouts() -> None:
    sub = _subscribe(count=1000, pace=0.05)
    try:
        started = time.monotonic()
        assert not sub.wait(lambda s: False, timeout=0.3)
        assert STILL_ARRIVING * 0.3 - 0.05 <= time.monotonic() - started < STILL_ARRIVING * 0.3 + 1.0
    finally:
        sub.close()


def test_a_wait_without_a_timeout_lasts_the_runs_event_wait() -> None:
    target = SimpleNamespace(control=PacedControl(count=1, pace=0.05), options=Options(event_wait_s=0.4),
                             observe=lambda response: None)
    sub = subscribe(target, include_snapshot=True)  # waits for its first response (the snapshot)
    try:
        assert sub.event_wait_s == 0.4 and len(sub.batches) == 1
        started = time.monotonic()
        assert not sub.wait_sequence(2)
        assert 0.3 <= time.monotonic() - started < 1.5  # the default 10 s would run past this
    finally:
        sub.close()


def test_the_event_wait_comes_from_the_command_line() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, positional=True)
    assert options_from_args(parser.parse_args(["127.0.0.1:1", "--event-wait", "25"])).event_wait_s == 25.0
    assert options_from_args(parser.parse_args(["127.0.0.1:1"])).event_wait_s == EVENT_WAIT_S == 10.0
