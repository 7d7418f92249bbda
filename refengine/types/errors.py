"""Refusals before acceptance (``RequestError`` and its kinds; the edge maps each to a
gRPC status), and ``KvSessionNotFound``.
"""

from __future__ import annotations


class RequestError(Exception):
    """A request refused before acceptance. Nothing was allocated for it."""


class InvalidRequestError(RequestError, ValueError):
    """The request is malformed or out of range; the message says what is wrong."""


class DuplicateRequestError(RequestError):
    """``request_id`` is already in use by an active request."""


class KvSessionNotFound(LookupError):
    """No such KV session here: never made, released, or its lease expired (K7, A2)."""


class KvSessionMismatch(ValueError):
    """A pin named other blocks or memory than the session holds: nothing was pinned."""



class FeatureDisabledError(RequestError):
    """A feature this engine was started without (ref: KV events under ``--no-kv-events``), as R5
    has LoRA's: FAILED_PRECONDITION, not INVALID_ARGUMENT (the request is fine; the server is not
    set up for it)."""


class LoraDisabledError(FeatureDisabledError):
    """LoRA is not enabled on this engine (R5)."""


class LoraNotFoundError(RequestError, LookupError):
    """No loaded adapter has that name (R4): unload, or ``lora_name`` in a request."""


class LoraConflictError(RequestError):
    """A load whose id, name or path collides with a different loaded adapter (R3)."""


class OverloadedError(RequestError):
    """The engine cannot take more work now; retrying later may succeed."""


class EngineStoppedError(OverloadedError):
    """The engine was shut down, or stopped after a fault it could not recover from: another
    replica may take the request (so it stays an overload to a client), this one will not."""
