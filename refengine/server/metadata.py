"""gRPC request metadata (RULES M1–M5).

Keys (lowercase ASCII, at most one value each for ``openengine-*``):

- ``openengine-routing-key``    opaque non-empty ASCII; accepted and logged (one instance, no
  routing of our own);
- ``openengine-target-dp-rank`` base-10 uint32; this server is data-parallel size 1, so only
  rank 0 is accepted (ref: any other rank → INVALID_ARGUMENT, the target does not exist here);
- ``openengine-priority``       base-10 int32, higher = sooner → ``GenerationRequest.priority``
  (advertised as ``supports_priority``, M4);
- ``traceparent``/``tracestate`` W3C trace context, accepted on every RPC (never read as an
  error: a malformed ``traceparent`` is ignored, as W3C Trace Context prescribes). A Generate
  request's goes into ``GenerationRequest.trace`` and is sent on the calls made for it
  downstream, the KV and embedding pulls (M5); Control RPCs make no downstream calls.

Malformed numbers, an empty routing key and a repeated ``openengine-*`` key are
INVALID_ARGUMENT (M2). Routing/admission keys apply to Inference RPCs only; Control RPCs
read just the trace context. Unknown ``openengine-*`` keys are ignored (forward compatible).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from refengine.server.errors import invalid

ROUTING_KEY = "openengine-routing-key"
DATA_PARALLEL_RANKS = (0,)  # this server's ranks: data-parallel size 1
TARGET_DP_RANK = "openengine-target-dp-rank"
PRIORITY = "openengine-priority"
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

_UINT = re.compile(r"[0-9]+")
_INT = re.compile(r"-?[0-9]+")
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
UINT32_MAX = (1 << 32) - 1
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1


@dataclass(frozen=True)
class TraceContext:
    traceparent: str
    tracestate: str | None = None

    def as_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata to attach to a downstream RPC (e.g. a KV transfer call)."""
        pairs = [(TRACEPARENT, self.traceparent)]
        if self.tracestate:
            pairs.append((TRACESTATE, self.tracestate))
        return tuple(pairs)


@dataclass(frozen=True)
class RequestMetadata:
    routing_key: str | None = None
    target_dp_rank: int | None = None
    priority: int | None = None
    trace: TraceContext | None = None


def _values(metadata: Iterable[tuple[str, str | bytes]] | None) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for key, value in metadata or ():
        key = key.lower()
        if isinstance(value, bytes):  # only "-bin" keys carry bytes; none of ours do
            continue
        found.setdefault(key, []).append(value)
    return found


def _trace(found: dict[str, list[str]]) -> TraceContext | None:
    parents = found.get(TRACEPARENT, [])
    if len(parents) != 1 or not _TRACEPARENT.fullmatch(parents[0].strip()):
        return None
    states = found.get(TRACESTATE, [])
    return TraceContext(parents[0].strip(), ",".join(states) if states else None)



def _one(found: dict[str, list[str]], key: str) -> str | None:
    values = found.get(key)
    if not values:
        return None
    if len(values) > 1:
        raise invalid(f"metadata key {key!r} was sent {len(values)} times; send it at most once")
    return values[0]


def _number(key: str, text: str, pattern: re.Pattern[str], low: int, high: int, kind: str) -> int:
    """``text`` as an int in [low, high]. Leading zeros are stripped before ``int()``: Python
    refuses more than 4,300 digits (a ValueError, which became INTERNAL), and no int32 or uint32
    has more than 10."""
    digits = text.removeprefix("-").lstrip("0") or "0"
    if pattern.fullmatch(text) and len(digits) <= 10:
        value = -int(digits) if text.startswith("-") else int(digits)
        if low <= value <= high:
            return value
    shown = text if len(text) <= 32 else text[:32] + "..."
    raise invalid(f"metadata {key!r} must be a base-10 {kind}, got {shown!r}")


def check_rank(what: str, rank: int) -> None:
    """A data-parallel rank a request names must exist here (``DATA_PARALLEL_RANKS``)."""
    if rank not in DATA_PARALLEL_RANKS:
        raise invalid(f"{what} is {rank}, but this server has data_parallel_size 1 (only rank 0)")


def read_inference_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> RequestMetadata:
    """Parse and check the metadata of an Inference RPC (M1–M3). Raises ``Rejection``."""
    metadata = list(metadata or ())
    # Counted before _values drops the bytes of "-bin" keys: a repeated openengine-*-bin key is repeated too.
    for key, count in Counter(key.lower() for key, _ in metadata).items():
        if key.startswith("openengine-") and count > 1:
            raise invalid(f"metadata key {key!r} was sent {count} times; send it at most once")
    found = _values(metadata)
    routing_key = _one(found, ROUTING_KEY)
    if routing_key is not None and (not routing_key or not routing_key.isascii()):
        raise invalid(f"metadata {ROUTING_KEY!r} must be a non-empty ASCII string")
    rank_text = _one(found, TARGET_DP_RANK)
    rank = None if rank_text is None else _number(TARGET_DP_RANK, rank_text, _UINT, 0, UINT32_MAX, "uint32")
    if rank is not None:
        check_rank(f"metadata {TARGET_DP_RANK!r}", rank)
    priority_text = _one(found, PRIORITY)
    priority = None if priority_text is None else _number(PRIORITY, priority_text, _INT, INT32_MIN,
                                                          INT32_MAX, "int32")
    trace = _trace(found)
    return RequestMetadata(routing_key=routing_key, target_dp_rank=rank, priority=priority, trace=trace)
