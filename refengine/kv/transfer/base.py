"""The KV transfer interface: what moves, between whom, and how a failure reads.

A prefill engine holds a finished prompt's blocks as a *session*; a decode engine
allocates fresh blocks for the part of the prompt it does not have cached, and a
backend copies the session's blocks ``first_block_index …`` into them. Both engines
see their KV cache as a ``BlockStore``: raw regions (each layer's K, then V) of
``num_blocks`` equal blocks, the block being the outermost dimension, so one block of
one region is one contiguous byte range. A transfer copies bytes; the two sides check
beforehand (``attributes``) that their layouts, dtypes and block sizes are equal.

Plain data and interfaces only: no torch, no grpc (the server's gRPC backend and the
NIXL backend both implement ``KvTransferBackend``).
"""

from __future__ import annotations

import hashlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from refengine.types import KvSessionSpec


@dataclass(frozen=True)
class KvRegion:
    """One KV tensor as memory: ``num_blocks`` blocks of ``block_nbytes`` from ``address``."""

    address: int
    num_blocks: int
    block_nbytes: int


class BlockStore(Protocol):
    """An engine's KV cache as raw blocks (``refengine.model.kv_io.KvBlockIO``).

    ``read``/``write`` move whole blocks, region-major (region 0's range of each block in
    order, then region 1's, …), ``block_nbytes`` bytes per block over all regions. Thread-safe for
    blocks nobody else writes: a session's blocks are immutable while it is held, and a
    decode engine's destination blocks are not scheduled until their pull has ended."""

    layout: str  # the attention backend's layout name and per-block shapes: equal strings = compatible bytes
    dtype: str
    regions: tuple[KvRegion, ...]
    block_nbytes: int  # over all regions

    def read(self, block_ids: Sequence[int]) -> bytes: ...

    def write(self, block_ids: Sequence[int], data: bytes | memoryview) -> None: ...


@dataclass(frozen=True)
class PullOrder:
    """Copy the session's blocks ``first_block_index … first_block_index + len(dest)-1``
    into this engine's ``dest_block_ids`` (in order)."""

    request_id: str
    session: KvSessionSpec
    first_block_index: int
    dest_block_ids: tuple[int, ...]
    trace: tuple[tuple[str, str], ...] = ()  # the request's trace context, for the transfer's RPCs (M5)
    # What the source's session must hold (KvSessionStore.content): a prompt (``session_content``),
    # an embedding handle's media identity (ENC8); the puller keys its prefix cache by it.
    # "" = not checked.
    content: str = ""


#: The gRPC initial metadata in which a KvPull source says what a session holds, as
#: :func:`content_digest` of ``KvSessionStore.content`` (any text, sent as ASCII hex).
SESSION_CONTENT_KEY = "refengine-session-content"


def content_digest(content: str) -> str:
    return hashlib.sha256(content.encode()).hexdigest()


def pinned_content(content: str, block_ids: Sequence[int], read_from: str = "") -> str:
    """What a pin's source says it holds: the content, the blocks a one-sided READ reads and
    ``read_from``, the identity of the memory it reads (``nixl_source.source_identity``). The
    reader takes blocks and memory from the session's attributes, which come with the request:
    a client could name its own agent there, so both are checked against the source."""
    return f"{content}; blocks {','.join(map(str, block_ids))}; from {read_from}"


class Cancellation(threading.Event):
    """A pull's cancel flag that can also wake a pull blocked on the network: ``on_cancel``
    callbacks run once, when it is set (at once if it already is). A transfer blocked reading
    a stream registers the stream's cancel, so that a cancelled request frees its transfer
    thread now, not when the source answers or the pull times out."""

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], None]] = []
        self._callbacks_lock = threading.Lock()

    def set(self) -> None:
        with self._callbacks_lock:
            super().set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def on_cancel(self, callback: Callable[[], None]) -> None:
        with self._callbacks_lock:
            if not self.is_set():
                self._callbacks.append(callback)
                return
        callback()


class TransferFailure(Exception):
    """A pull that did not complete. ``kind`` "not_found": the source no longer holds the
    session (KV_SESSION_NOT_FOUND, never retryable); "failed": KV_TRANSFER_FAILED, with
    ``retryable`` true only when the source still holds the session as far as we know.
    ``dest_may_change``: a write into the destination could not be stopped (a one-sided
    READ that outlived its drain); the engine then never reuses those blocks."""

    def __init__(self, kind: Literal["not_found", "failed"], message: str, retryable: bool = False,
                 dest_may_change: bool = False, pin_held: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.retryable = retryable and kind == "failed"
        self.dest_may_change = dest_may_change
        self.pin_held = pin_held  # a pin's failure after the source made it (its content check)


#: A pull of session_id that had pinned it (a one-sided READ, ``SessionPinner``) is over:
#: ``(session_id, pulled)``. Pulled: release the session and end that pin. Not pulled (the READ or
#: the content check failed): end that pin only; the session stays offered for another pull. Only
#: one-sided backends call it; a gRPC pull confirms through its service.
SessionConfirmed = Callable[[str, bool], None]


class KvTransferBackend(ABC):
    """One way of moving a session's blocks. ``bind`` is called once, by the engine that
    owns ``store``, before anything else.

    Invariants: ``pull`` writes only into ``order.dest_block_ids``, and returns or raises
    only when no write into them is pending any more (the engine frees or schedules them
    right after) — or raises with ``dest_may_change`` when it cannot stop one; it checks
    ``cancelled`` between chunks and then raises. A backend never holds or frees blocks
    itself: the engine's session store does. ``on_confirmed`` may be called on any thread
    (NIXL: its notification thread), also for a pull that raised after its copy ended."""

    name: str  # as in KvSessionRef.transfer_backend
    protocol: str  # as in KvEndpoint.protocol of the sessions it offers
    #: Source side, once bound: the identity of this engine's memory as a one-sided reader of
    #: it names it (``pinned_content``'s ``read_from``); "" for a backend no one READs through.
    read_identity: str = ""

    @abstractmethod
    def bind(self, store: BlockStore, on_confirmed: SessionConfirmed) -> None:
        """Attach to the engine's KV cache; ``on_confirmed`` releases a session pulled by a pinned READ."""

    def source_attributes(self, session_id: str, block_ids: Sequence[int]) -> dict[str, Any]:
        """Prefill side: what a puller needs besides the session id (JSON values, K9)."""
        return {}

    def source_problem(self, transfer: Mapping[str, Any], num_blocks: int) -> str:
        """Decode side, before acceptance (K5): what makes a session's ``transfer`` attributes
        unusable by this backend for a session of ``num_blocks`` blocks, whatever they hold
        ("" when nothing does)."""
        return ""

    @abstractmethod
    def pull(self, order: PullOrder, cancelled: Cancellation) -> None:
        """Decode side, blocking, on a transfer thread: fetch and write the blocks, then tell
        the source (``on_confirmed`` there). Raises ``TransferFailure``. A backend that blocks on
        the network registers its wake-up with ``cancelled.on_cancel``, so that a request ending
        frees its transfer thread at once."""

    @abstractmethod
    def close(self) -> None:
        """Release connections and registrations (idempotent)."""


def read_identity(backends: Iterable[KvTransferBackend]) -> str:
    """The identity one-sided readers name this engine's memory by: the first bound backend's
    that has one ("" when none is READ through)."""
    return next((b.read_identity for b in backends if b.read_identity), "")


@runtime_checkable
class SessionPinner(Protocol):
    """Decode side, for one-sided backends (NIXL READ): ask the source engine to keep a
    session's blocks unchanged for ``seconds`` while they are read without its involvement
    (the server implements it with the ``refengine.kvpull.v1`` Pin RPC).

    A pin that succeeds also proves the session was live, its blocks unchanged, from its
    hand-over until the pin: so a READ may run while the pin is in flight, and what it read
    is good once the pin succeeds (and discarded when it fails)."""

    def start_pin(self, session: KvSessionSpec, seconds: float, trace: tuple[tuple[str, str], ...] = (),
                  content: str = "", cancelled: Cancellation | None = None) -> Callable[[], float]:
        """Send the pin (with ``trace`` as its metadata); returns a function that waits for its
        outcome: the ``time.monotonic()`` until which the pin surely holds (the source may grant
        less than ``seconds``; counted from the sending, as the source made it later), or raises
        ``TransferFailure`` ("not_found" when the source no longer holds the session; "failed"
        when it does not hold ``content``, ``PullOrder.content``: then ``pin_held``, as the source
        made the pin; "failed" when ``cancelled`` was set first)."""
