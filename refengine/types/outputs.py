"""What the engine returns: per-output deltas and finish reasons, usage, the faults that
end an accepted request, and the load figures (``EngineStats``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal, NamedTuple

from refengine.types.requests import KvSessionSpec


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class FinishInfo:
    """Why one output ended. For STOP exactly one of the three match fields is set."""

    reason: FinishReason
    stop_token_id: int | None = None
    stop_text: str | None = None
    eos_token_id: int | None = None
    message: str = ""


class Candidate(NamedTuple):
    """A named tuple, not a dataclass: an ``all`` request makes one per vocabulary entry and
    token (~50k), and a tuple is built several times faster."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank in the distribution the token was drawn from
    text: str


@dataclass(frozen=True)
class TokenInfo:
    """One token with its (optional) logprob, rank and candidates, all together."""

    token_id: int
    text: str
    logprob: float | None = None
    rank: int | None = None
    candidates: tuple[Candidate, ...] = ()


@dataclass(frozen=True)
class SequenceDelta:
    """What one output (``index``) produced this step: new tokens and new text only.

    ``finish`` is set on the output's last delta; nothing follows it for this index.
    """

    index: int
    tokens: tuple[TokenInfo, ...] = ()
    text: str = ""
    finish: FinishInfo | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class RequestOutput:
    """Everything a request produced in one engine step.

    ``prompt_tokens`` (prompt logprobs) appears at most once, before any output
    token. ``usage`` is set exactly on the final output (``finished`` True).
    ``error`` is set when the engine failed the request after acceptance; it is then
    also the final output.
    """

    request_id: str
    deltas: tuple[SequenceDelta, ...] = ()
    prompt_tokens: tuple[TokenInfo, ...] | None = None
    finished: bool = False
    usage: Usage | None = None
    error: EngineFault | None = None
    # A prefill engine's terminal success (K4): the session to pass to a decode engine; no
    # token deltas come with it. The edge adds the routable endpoints.
    prefill: KvSessionSpec | None = None

    @property
    def ended_by_abort(self) -> bool:
        """A final output in which an output was cancelled (an abort, a drain, a stalled
        client), rather than every output ending by its own stop."""
        return any(d.finish is not None and d.finish.reason is FinishReason.CANCELLED for d in self.deltas)


@dataclass(frozen=True)
class EngineFault:
    """A failure after acceptance. ``retryable``: the unchanged request could succeed later."""

    code: Literal["overloaded", "internal", "cancelled", "kv_transfer_failed", "kv_session_not_found",
                  "invalid_argument"]
    message: str
    retryable: bool


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of live load figures."""

    running_requests: int
    waiting_requests: int
    used_kv_blocks: int
    total_kv_blocks: int
    cached_kv_blocks: int
    running_tokens: int
    waiting_tokens: int
    prefill_batch_size: int  # sequences that computed prompt tokens in the last step
    decode_batch_size: int  # sequences that decoded in the last step
    active_kv_sessions: int = 0  # prefill role: sessions held for decode engines (K7)
    kv_pulled_bytes: int = 0  # decode role: KV received by successful pulls, in total
    kv_pull_seconds: float = 0.0  # ... and the time those pulls took
    withheld_kv_blocks: int = 0  # decode role: used for good, after pulls that could not stop writing
    media: MediaStats | None = None  # encoder role: its handles and rows
    embedding_pulled_bytes: int = 0  # consumers: embedding rows received from encoders, in total
    embedding_pull_seconds: float = 0.0  # ... and the time those pulls took
    num_steps: int = 0  # steps the engine has run, in total: progress (a busy engine's steps advance)
    kv_event_subscribers: int = 0  # KV event streams being fed: SubscribeKvEvents calls, the ZMQ publisher


@dataclass(frozen=True)
class MediaStats:
    """An encoder's embedding memory: rows held by live handles, kept for reuse (the encoder
    cache, evictable) and free (held + cached + free = total), and its counters."""

    held_handles: int
    held_rows: int
    cached_rows: int
    free_rows: int
    total_rows: int
    cached_entries: int
    cache_hits: int
    cache_misses: int
