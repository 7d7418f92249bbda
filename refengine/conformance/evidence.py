"""What a failing check shows: the last few exchanges it had with the server.

:class:`Target` records every RPC it makes (the request, then the stream or the response or
the status) in a short ring; the runner clears it before each check and, when the check
fails, renders it here as plain JSON-able data. Long strings and lists are cut, so evidence
stays small however big the prompt or the stream was.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

#: Exchanges kept per check (the most recent), events kept per stream (first and last half).
MAX_EXCHANGES, MAX_EVENTS = 3, 8
MAX_STRING, MAX_LIST = 160, 8


@dataclass(frozen=True)
class Exchange:
    """One RPC: ``outcome`` is a StreamResult (Generate), a response message, or a status code."""

    rpc: str
    request: Message
    outcome: Any
    details: str = ""


class ExchangeLog:
    """The most recent :data:`MAX_EXCHANGES` exchanges (appends are safe across threads)."""

    def __init__(self) -> None:
        self._ring: deque[Exchange] = deque(maxlen=MAX_EXCHANGES)

    def record(self, rpc: str, request: Message, outcome: Any, details: str = "") -> None:
        self._ring.append(Exchange(rpc, request, outcome, details))

    def clear(self) -> None:
        self._ring.clear()

    def render(self) -> list[dict[str, Any]]:
        return [_render(e) for e in list(self._ring)]


def _render(exchange: Exchange) -> dict[str, Any]:
    out: dict[str, Any] = {"rpc": exchange.rpc, "request": message_dict(exchange.request)}
    outcome = exchange.outcome
    if isinstance(outcome, grpc.StatusCode):
        out["status"] = outcome.name
        if exchange.details:
            out["details"] = _cut(exchange.details)
    elif isinstance(outcome, Message):
        out["status"] = "OK"
        out["response"] = message_dict(outcome)
    else:  # a StreamResult
        out["status"] = outcome.code.name
        if outcome.details:
            out["details"] = _cut(outcome.details)
        events = [message_dict(e) for e in outcome.events]
        if len(events) > MAX_EVENTS:
            half = MAX_EVENTS // 2
            events = [*events[:half], f"... {len(events) - MAX_EVENTS} more event(s) ...", *events[-half:]]
        out["events"] = events
    return out


def message_dict(message: Message) -> Any:
    """proto3 JSON of ``message`` (field names as in the .proto), long values cut."""
    return _trim(json_format.MessageToDict(message, preserving_proto_field_name=True))


def _cut(text: str) -> str:
    return text if len(text) <= MAX_STRING else f"{text[:MAX_STRING]}... ({len(text)} chars)"


def _trim(value: Any) -> Any:
    if isinstance(value, str):
        return _cut(value)
    if isinstance(value, list):
        kept = [_trim(v) for v in value[:MAX_LIST]]
        return kept + [f"... {len(value) - MAX_LIST} more"] if len(value) > MAX_LIST else kept
    if isinstance(value, dict):
        return {k: _trim(v) for k, v in value.items()}
    return value
