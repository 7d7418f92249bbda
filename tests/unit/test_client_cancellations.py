"""The client library when a stream is cancelled or a hop fails around the prefill's session
(found by review): a decode ended by Finished(CANCELLED) before its pull left the prefill
server's session held until its lease; a caller that closed the prefill client first got a
traceback from the iterator's close; the release waited the client's 30 s past the call's
deadline; ``stream_text`` ended a cancelled stream quietly and, on a prefill server, left the
session held; ``refengine generate`` exited 0 on a cancelled request; a client deadline of inf
failed every call."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from refengine import client as client_module
from refengine.client import GenerationError, generate_disaggregated, stream_text
from refengine.commands.generate_run import _raise_if_failed
from refengine.protocol import oe

SESSION = oe.KvSessionRef(session_id="s-1")
READY = oe.GenerateResponse(prefill_ready=oe.PrefillReady(kv_session=SESSION))
CANCELLED = oe.GenerateResponse(finished=oe.GenerationFinished(reason=oe.FINISH_REASON_CANCELLED, message="aborted"))
STOPPED = oe.GenerateResponse(finished=oe.GenerationFinished(reason=oe.FINISH_REASON_STOP))


class FakeClient:
    """A client whose Generate yields ``events``; records its aborts (or fails them as closed)."""

    def __init__(self, events: list[oe.GenerateResponse], closed: bool = False) -> None:
        self.events, self.closed = events, closed
        self.aborts: list[tuple[str, float | None]] = []

    def generate(self, *args: Any, **kwargs: Any) -> Iterator[oe.GenerateResponse]:
        yield from self.events

    def abort(self, *, kv_session: oe.KvSessionRef, timeout: float | None = None) -> oe.AbortResponse:
        if self.closed:
            raise ValueError("Cannot invoke RPC on closed channel!")
        self.aborts.append((kv_session.session_id, timeout))
        return oe.AbortResponse()

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def default_model(self) -> str:
        return "m"


@pytest.mark.parametrize(("decode_events", "released"), [
    ([CANCELLED], True),  # cancelled while queued: never pulled, so released now
    ([STOPPED], False),  # decoded: the decode server pulled (and released) it
])
def test_the_session_is_released_unless_the_decode_finished(decode_events: list, released: bool) -> None:
    prefill_client, decode_client = FakeClient([READY]), FakeClient(decode_events)
    events = list(generate_disaggregated(prefill_client, decode_client, oe.GenerateRequest(), timeout=2.5))
    assert events == decode_events
    assert prefill_client.aborts == ([("s-1", 2.5)] if released else [])  # within the call's deadline


def test_closing_the_iterator_after_the_prefill_client_is_closed_does_not_raise() -> None:
    prefill_client = FakeClient([READY], closed=True)
    token = oe.GenerateResponse(token=oe.TokenOutput(text="Hel"))
    events = generate_disaggregated(prefill_client, FakeClient([token, STOPPED]), oe.GenerateRequest())
    assert next(events) == token
    events.close()  # abandoned mid-decode: the release fails (closed channel), best effort, silent


def test_stream_text_raises_on_a_cancelled_stream_and_releases_a_prefill_session(
        monkeypatch: pytest.MonkeyPatch) -> None:
    token = oe.GenerateResponse(token=oe.TokenOutput(text="Hel"))
    monkeypatch.setattr(client_module, "OpenEngineClient", lambda address: FakeClient([token, CANCELLED]))
    texts = []
    with pytest.raises(GenerationError, match="ERROR_CODE_CANCELLED: aborted"):
        texts.extend(stream_text("h:1", "hi"))
    assert texts == ["Hel"]
    prefill_server = FakeClient([READY])
    monkeypatch.setattr(client_module, "OpenEngineClient", lambda address: prefill_server)
    with pytest.raises(GenerationError, match="h:1 is a prefill server"):
        list(stream_text("h:1", "hi"))
    assert prefill_server.aborts == [("s-1", None)]


def test_the_cli_fails_a_cancelled_request() -> None:
    with pytest.raises(GenerationError, match="ERROR_CODE_CANCELLED: aborted"):
        _raise_if_failed(CANCELLED, FakeClient([]), None)
    _raise_if_failed(STOPPED, FakeClient([]), None)


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), 0.0, -1.0, 1e12])
def test_a_client_deadline_no_call_could_keep_is_refused(timeout: float) -> None:
    """inf or nan made every call fail at once with DEADLINE_EXCEEDED (found by review)."""
    with pytest.raises(ValueError, match="timeout must be in"):
        client_module.OpenEngineClient("127.0.0.1:1", timeout=timeout)
