"""KV sessions a prefill engine holds for decode engines, each under a lease (K7).

A session owns a finished prompt's blocks (a named owner in ``KvCacheManager``) until it
is *due*: released (the decode engine confirmed its pull, or ``Abort(kv_session)``, or a
drain) or past its lease — and, in both cases, not being read. Reads are of two kinds:
an in-process read of some blocks (the gRPC pull, ``begin_read``/``end_read``) and a
*pin* (``pin``: a one-sided NIXL READ from the decode engine that this engine cannot see
end; it lasts ``seconds`` or until the confirmation — with several pins, e.g. two decode
engines pulling one session, until every pinner confirmed: one's confirmation cannot end
another's READ, nor can the confirmation of a pull that never pinned). A due session's blocks are freed by
the step thread (``take_due``), the only one that touches the pool, so a block is never
reused while a read of it can still be in flight.

Thread-safe: the step thread adds and frees; any thread reads, pins and releases.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from refengine.kv.transfer.base import content_digest, pinned_content
from refengine.types import KvSessionMismatch, KvSessionNotFound


@dataclass(eq=False)
class KvSession:
    session_id: str
    content: str  # what it holds, said to its readers (``content``)
    block_ids: tuple[int, ...]
    expires_at: float  # time.monotonic() of the lease's end
    readers: int = 0  # in-process reads in progress
    pinned_until: float = 0.0  # a remote one-sided read may run until then
    pins: int = 0  # pins whose pull has not been confirmed: the last confirmation ends the pin early
    release_reason: str | None = None  # set: free as soon as nothing reads it

    @property
    def owner(self) -> str:
        """Its name as a KV owner (``KvCacheManager.transfer``)."""
        return f"session:{self.session_id}"

    def is_due(self, now: float) -> bool:
        if self.readers or self.pinned_until > now:
            return False
        return self.release_reason is not None or now >= self.expires_at


class KvSessionStore:
    def __init__(self, on_change: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._sessions: dict[str, KvSession] = {}
        self._lock = threading.Lock()
        self._on_change = on_change  # wakes the step loop: something may have become due
        self._clock = clock

    def add(self, session: KvSession) -> None:
        with self._lock:
            assert session.session_id not in self._sessions, "session ids are unique"
            self._sessions[session.session_id] = session

    def _live(self, session_id: str) -> KvSession:
        """A session still offered: known, not released, lease not over (lock held)."""
        session = self._sessions.get(session_id)
        if session is None or session.release_reason is not None or self._clock() >= session.expires_at:
            raise KvSessionNotFound(f"KV session {session_id!r} not found: never made here, released or expired")
        return session

    def begin_read(self, session_id: str) -> tuple[int, ...]:
        """Start reading a live session's blocks; returns its block ids. Pair with ``end_read``."""
        with self._lock:
            session = self._live(session_id)
            session.readers += 1
            return session.block_ids

    def end_read(self, session_id: str) -> None:
        with self._lock:
            session = self._sessions[session_id]
            session.readers -= 1
            due = session.is_due(self._clock())
        if due:  # the last reader of a released or expired session: wake the step loop to free it
            self._on_change()

    def pin(self, session_id: str, seconds: float, check: Callable[[KvSession], None] | None = None,
            ) -> tuple[int, ...]:
        """Keep a live session's blocks for a one-sided read of up to ``seconds`` (it also
        outlives its lease that long). Returns its block ids. ``check`` may refuse the pin by
        raising (nothing is pinned then)."""
        with self._lock:
            session = self._live(session_id)
            if check is not None:
                check(session)
            session.pinned_until = max(session.pinned_until, self._clock() + seconds)
            session.pins += 1
            return session.block_ids

    def unpin(self, session_id: str) -> None:
        """A pinned read failed: its pin ends (the last one ends the window early); the session
        stays offered for another pull. Nothing when no pin is counted."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or not session.pins:
                return
            session.pins -= 1
            if not session.pins:
                session.pinned_until = 0.0
        self._on_change()

    def content(self, session_id: str) -> str:
        """What a live session holds (a prefill session's prompt, an embedding handle's media
        identity): its source says it, and the puller checks it before using the blocks."""
        with self._lock:
            return self._live(session_id).content

    def num_blocks(self, session_id: str) -> int:
        """How many blocks a live session holds."""
        with self._lock:
            return len(self._live(session_id).block_ids)

    def renew(self, session_id: str, seconds: float) -> float:
        """Set a live session's lease to end ``seconds`` from now; returns that end (the clock's time)."""
        with self._lock:
            session = self._live(session_id)
            session.expires_at = self._clock() + seconds
        self._on_change()  # a shorter lease may be due sooner than the loop waits
        return session.expires_at

    def release(self, session_id: str, reason: str, pulled: bool = False, pinned: bool = False) -> bool:
        """Ask to free a session (``pulled``: a decode engine confirmed its pull). ``pinned``
        (with ``pulled``): that pull had pinned the session (a one-sided READ), so its own pin
        ends, and the pin window with the last one. A pull that pinned nothing (gRPC's, read
        here under ``begin_read``) ends no pin: another engine's READ of the same session may
        still run. False when there is no such session, it was released already, or (unless
        ``pulled``) its lease is over: a pin may still keep an expired session's blocks for a
        read in flight, but it is no longer offered, so releasing it releases nothing (ENC6)."""
        assert pulled or not pinned, "only a pull's confirmation ends a pin"
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                return False
            if pinned and session.pins:  # another pinner's READ may still run until its own confirmation
                session.pins -= 1
                if not session.pins:
                    session.pinned_until = 0.0
            first = session.release_reason is None
            offered = self._clock() < session.expires_at
            if first:
                session.release_reason = reason
        self._on_change()
        return first and (offered or pulled)

    def release_all(self, reason: str) -> int:
        with self._lock:
            live = [s for s in self._sessions.values() if s.release_reason is None]
            for session in live:
                session.release_reason = reason
        self._on_change()
        return len(live)

    def take_due(self) -> list[KvSession]:
        """Remove and return the sessions whose blocks may be freed now (step thread)."""
        now = self._clock()
        with self._lock:
            due = [s for s in self._sessions.values() if s.is_due(now)]
            for session in due:
                del self._sessions[session.session_id]
        return due

    def seconds_until_due(self) -> float | None:
        """Until the next lease or pin ends (None: no session)."""
        with self._lock:
            if not self._sessions:
                return None
            now = self._clock()
            ends = []
            for s in self._sessions.values():
                end = max(s.expires_at if s.release_reason is None else now, s.pinned_until)
                if s.readers and end <= now:
                    continue  # due but for its readers: the last one's end_read wakes the loop
                # Read or not, a lease or pin ending later is waited for: end_read wakes nobody then.
                ends.append(end)
        return max(0.0, min(ends) - now) if ends else None

    def __len__(self) -> int:
        """Sessions still offered (live)."""
        now = self._clock()
        with self._lock:
            return sum(1 for s in self._sessions.values() if s.release_reason is None and now < s.expires_at)

    def __contains__(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._sessions


def expecting(expected_content: str, read_from: str) -> Callable[[KvSession], None] | None:
    """A ``pin`` check: the session holds what the reader will READ (``expected_content``, the
    digest of ``pinned_content``; ``read_from``: this engine's memory, ``read_identity``)."""
    if not expected_content:
        return None

    def check(session: KvSession) -> None:
        if content_digest(pinned_content(session.content, session.block_ids, read_from)) != expected_content:
            raise KvSessionMismatch(f"KV session {session.session_id!r} holds another item than the pin names "
                                    "(its content, its blocks, or the memory they are read from)")
    return check
