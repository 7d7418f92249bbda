"""Failures → the wire (RULES X1–X3).

Two transports, chosen by *when* a failure happens (X1):

- before acceptance (validation, admission): a non-OK gRPC status, no events. Raise
  :class:`Rejection`; the servicer turns it into a status with :func:`abort_call`;
- after acceptance (the engine took the request): exactly one terminal
  ``EngineError`` event, then status OK. :func:`engine_error` builds it.

``retryable`` is true only when the unchanged request could succeed later (X3):
overload and a stream cut off by the drain, never invalid input or an engine fault.
The release has no DRAINING error code: a drain cut-off is ``CANCELLED`` with
``retryable = true`` and a message that names the drain (ref, X3).
"""

from __future__ import annotations

import asyncio
from typing import NoReturn

import grpc

from refengine.protocol import oe
from refengine.server.stream_bridge import OVERFLOW_FACTOR
from refengine.types import (
    DuplicateRequestError,
    EngineFault,
    EngineStoppedError,
    FeatureDisabledError,
    InvalidRequestError,
    LoraConflictError,
    LoraNotFoundError,
    OverloadedError,
    RequestError,
)

#: Engine refusals → status codes. Overload is RESOURCE_EXHAUSTED, the gRPC code for
#: admission/capacity exhaustion; the LoRA ones are R3–R5's.
REFUSAL_CODES: tuple[tuple[type[RequestError], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (DuplicateRequestError, grpc.StatusCode.ALREADY_EXISTS),
    (EngineStoppedError, grpc.StatusCode.UNAVAILABLE),  # before its base class: this instance serves no more
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (LoraNotFoundError, grpc.StatusCode.NOT_FOUND),
    (LoraConflictError, grpc.StatusCode.ALREADY_EXISTS),
    (FeatureDisabledError, grpc.StatusCode.FAILED_PRECONDITION),  # LoRA's R5, KV events' (ref)
)


#: A status message travels as the ``grpc-message`` trailer, percent-encoded (up to 3 bytes a
#: UTF-8 byte), and peers drop a call whose metadata passes their limit (8 KiB soft, 16 KiB hard
#: by default) as RESOURCE_EXHAUSTED: found by review, a message echoing a client's 20,000-character
#: model name hid G3's NOT_FOUND that way.
MAX_STATUS_MESSAGE_BYTES = 1024


def bounded_message(message: str) -> str:
    """``message`` in at most ``MAX_STATUS_MESSAGE_BYTES`` of UTF-8: when longer, its start and a
    suffix saying how long it was, the two within the bound."""
    encoded = message.encode()
    if len(encoded) <= MAX_STATUS_MESSAGE_BYTES:
        return message
    suffix = f"... ({len(message)} characters in all)"
    kept = encoded[:MAX_STATUS_MESSAGE_BYTES - len(suffix.encode())].decode(errors="ignore")
    return kept + suffix


async def abort_call(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """End the call with a non-OK status: every servicer's way (``context.abort`` raises)."""
    await context.abort(code, bounded_message(message))
    raise AssertionError("context.abort always raises")


def disconnect(context: grpc.aio.ServicerContext, write: asyncio.Future, message: str) -> NoReturn:
    """End the handler of a stream whose ``write`` the client never takes (its receive window is
    full). ``context.abort`` would wait for that write (the status goes out behind it: found by
    review, a handler and its drain waited for good), so it runs on its own: a client that reads
    again gets what was in flight, then RESOURCE_EXHAUSTED (X1: a transport failure is a status).
    The write is not cancelled: gRPC cannot end a call whose send was abandoned mid-way. The
    handler ends now, as a cancelled one (its cleanup runs as for a client cancel)."""
    abort = asyncio.ensure_future(context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, bounded_message(message)))
    for pending in (write, abort):
        pending.add_done_callback(lambda task: task.cancelled() or task.exception())  # the call's end settles it
    raise asyncio.CancelledError


class Rejection(Exception):
    """A request refused before acceptance: a gRPC status code and a message saying
    what is wrong (never a stack trace)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = bounded_message(message)


def invalid(message: str) -> Rejection:
    return Rejection(grpc.StatusCode.INVALID_ARGUMENT, message)


def rejection_from_engine(exc: RequestError) -> Rejection:
    """An engine refusal (``add_request``, the LoRA lifecycle; nothing changed) → a status."""
    for kind, code in REFUSAL_CODES:
        if isinstance(exc, kind):
            return Rejection(code, str(exc))
    return Rejection(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")


#: EngineFault.code (engine vocabulary) → ErrorCode (wire vocabulary).
ERROR_CODES = {
    "overloaded": oe.ERROR_CODE_OVERLOADED,
    "internal": oe.ERROR_CODE_INTERNAL,
    "cancelled": oe.ERROR_CODE_CANCELLED,
    "kv_transfer_failed": oe.ERROR_CODE_KV_TRANSFER_FAILED,
    "kv_session_not_found": oe.ERROR_CODE_KV_SESSION_NOT_FOUND,
    "invalid_argument": oe.ERROR_CODE_INVALID_ARGUMENT,
}

#: Faults the server itself raises after acceptance (the engine never sees them).
STALLED_CONSUMER = EngineFault(
    "overloaded",
    "the client did not read the stream for longer than the stall timeout; the request was "
    "aborted to free its resources; retry and read the stream promptly",
    retryable=True,
)
OUTRUN_CONSUMER = EngineFault(
    "overloaded",
    "the client read the stream slower than the engine produced it, and the output waiting for it "
    f"passed {OVERFLOW_FACTOR}x the server's --stream-buffer-mib; the request was aborted to free its memory; "
    "retry, reading promptly or asking for fewer logprob candidates",
    retryable=True,
)
DRAINED = EngineFault(
    "cancelled",
    "cancelled by the server's drain: it is shutting down and the grace period ended before the "
    "request finished; retry on another instance",
    retryable=True,
)


def engine_error(fault: EngineFault) -> oe.EngineError:
    return oe.EngineError(
        code=ERROR_CODES.get(fault.code, oe.ERROR_CODE_INTERNAL),
        message=fault.message,
        retryable=fault.retryable,
    )
