"""Server lifecycle shared by every servicer (RULES H3).

``STARTING`` (listening, model loading on a worker thread) → ``READY`` (engine running) →
``DRAINING`` (SIGTERM/SIGINT: no new Generate, running streams finish within the grace
period) → the process exits. ``NOT_READY``: the model failed to load. These are the server's
own states; on the wire ``DRAINING`` is ``HEALTH_STATE_NOT_READY`` (H3: the release has no
draining state).

All mutation happens on the event loop thread; the engine is reached only through its
thread-safe API (``add_request``, ``abort``, ``stats``, ...).
"""

from __future__ import annotations

import contextlib
import enum
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import grpc

from refengine.config import EngineConfig
from refengine.engine.interface import EngineClient
from refengine.protocol import oe
from refengine.server.capabilities import Capabilities, capabilities_of
from refengine.server.convert import session_ref
from refengine.server.errors import DRAINED, Rejection
from refengine.server.options import ServerOptions
from refengine.server.stream_bridge import OutputBridge
from refengine.server.workers import SlowWork
from refengine.types import KvEndpointSpec, KvSessionSpec


class Drainable(Protocol):
    def drain(self) -> None:
        """End the stream with a terminal, retryable EngineError: the server is going away."""


@dataclass
class ReuseWait:
    """A Generate call waiting for its id's cancelled namesake to retire (G2). An Abort of the id
    meanwhile is meant for it, the namesake being ended already: ``aborted`` says to abort the
    new request as soon as it is accepted (A2, A4)."""

    aborted: bool = False


class Lifecycle(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    NOT_READY = "not_ready"


class ServerState:
    def __init__(self, options: ServerOptions, engine_config: EngineConfig) -> None:
        self.options = options
        self.engine_config = engine_config
        self.instance_id = options.instance_id or f"refengine-{uuid.uuid4().hex[:12]}"  # None: random
        self.lifecycle = Lifecycle.STARTING
        self.engine: EngineClient | None = None  # once loaded
        self.caps: Capabilities | None = None
        self.load_error: str | None = None
        self.engine_error: str | None = None  # why a loaded engine stopped serving (set_engine_stopped)
        self.started_at = time.monotonic()
        self.streams: set[OutputBridge] = set()  # accepted Generate streams not yet ended
        # Generate calls inside acceptance (validation, a grammar compiled on a worker thread),
        # Encode and LoRA lifecycle calls under way: the drain waits for them (held_for_drain).
        self.accepting = 0
        self.drain_deadline_passed = False  # from then on, a stream is cut off as soon as it is accepted
        # Streams that ended (client cancel, disconnect) before their engine request did, by
        # request id, until the engine confirms the abort: a new request reusing the id waits (G2).
        self.retiring: dict[str, OutputBridge] = {}
        # Generate calls waiting for a retiring id to reuse it, by id (G2): reuse_wait, flag_reusing.
        self.reusing: dict[str, list[ReuseWait]] = {}
        # Live SubscribeKvEvents streams: each one's drain() ends it with a retryable error (X3).
        self.kv_subscribers: set[Drainable] = set()
        # The compatibility KV event source (--kv-events-zmq) as GetKvEventSources reports it.
        self.kv_event_source: dict | None = None
        self.kv_endpoints: tuple[KvEndpointSpec, ...] = ()  # where this (prefill) server serves its sessions
        self.slow_work = SlowWork()  # Generate's acceptance and Encode: off asyncio's default executor
        self._listeners: list[Callable[[Lifecycle], None]] = []

    @contextlib.contextmanager
    def held_for_drain(self) -> Iterator[None]:
        """Work a drain's grace period waits for as for a running stream (X3): a Generate inside
        acceptance, an Encode, a LoadLora or UnloadLora under way. Otherwise the listeners' stop
        cancelled it 0.5 s after SIGTERM, whatever the grace period (found by review)."""
        self.accepting += 1
        try:
            yield
        finally:
            self.accepting -= 1

    def on_change(self, listener: Callable[[Lifecycle], None]) -> None:
        self._listeners.append(listener)

    def _set(self, lifecycle: Lifecycle) -> None:
        self.lifecycle = lifecycle
        for listener in self._listeners:
            listener(lifecycle)

    def set_ready(self, engine: EngineClient) -> None:
        self.engine = engine
        self.caps = capabilities_of(engine.info)
        if self.lifecycle is Lifecycle.STARTING:
            self._set(Lifecycle.READY)

    def set_load_failed(self, message: str) -> None:
        self.load_error = message
        self._set(Lifecycle.NOT_READY)

    def set_engine_stopped(self, reason: str) -> None:
        """The engine stopped itself after a fault: it serves nothing any more (H3: NOT_READY;
        grpc.health.v1 NOT_SERVING through the listeners; new Generate calls UNAVAILABLE)."""
        self.engine_error = reason
        if self.lifecycle is not Lifecycle.NOT_READY:
            self._set(Lifecycle.NOT_READY)

    def set_draining(self) -> None:
        if self.lifecycle in (Lifecycle.STARTING, Lifecycle.READY):
            self._set(Lifecycle.DRAINING)

    def add_stream(self, bridge: OutputBridge) -> None:
        """Register an accepted stream. One whose acceptance was still under way at the drain
        deadline is cut off at once, like those the deadline found open (X3)."""
        self.streams.add(bridge)
        if self.drain_deadline_passed:
            self._cut_off(bridge)

    def cut_off_streams(self) -> int:
        """The drain deadline: every open stream ends with one ``EngineError(CANCELLED,
        retryable)`` naming the drain, and its engine request is aborted (its KV freed).
        Returns how many were cut off (those whose engine request had already finished end
        with their own outcome)."""
        self.drain_deadline_passed = True
        return sum(self._cut_off(bridge) for bridge in list(self.streams))

    def flushed(self) -> bool:
        """After the drain deadline: nothing left to wait for (no stream, acceptance, subscription
        or engine request; every KV block free or cached). Blocks withheld for good after a transfer
        that could not stop writing never come back: waiting for them only held the exit for the
        whole flush bound (found by review). Nor do the blocks of an engine that stopped itself after a
        fault (``engine_error``): its loop is gone, and they stay counted as used (found by review:
        SIGTERM then took the whole 16 s bound to exit, whatever the grace period)."""
        engine = self.engine
        if self.streams or self.accepting or self.kv_subscribers or engine.has_unfinished_requests:
            return False
        if self.engine_error is not None:
            return True
        stats = engine.stats()
        return stats.used_kv_blocks <= stats.withheld_kv_blocks

    def _cut_off(self, bridge: OutputBridge) -> bool:
        if not bridge.fail(DRAINED):
            return False
        self.engine.abort(bridge.request_id)
        return True

    @contextlib.contextmanager
    def reuse_wait(self, request_id: str) -> Iterator[ReuseWait]:
        """A Generate call's wait to reuse ``request_id``, registered while it lasts."""
        wait = ReuseWait()
        waits = self.reusing.setdefault(request_id, [])
        waits.append(wait)
        try:
            yield wait
        finally:
            waits.remove(wait)
            if not waits:
                del self.reusing[request_id]

    def flag_reusing(self, request_id: str | None) -> bool:
        """Marks the calls waiting to reuse ``request_id`` (every id: None) as aborted; whether
        there were any."""
        waits = [w for rid, ws in self.reusing.items() if request_id in (None, rid) for w in ws]
        for wait in waits:
            wait.aborted = True
        return bool(waits)

    def session_ref(self, spec: KvSessionSpec) -> oe.KvSessionRef:
        """A prefill engine's session as the wire's ``KvSessionRef``, with this server's endpoints."""
        return session_ref(spec, self.kv_endpoints)

    def engine_for_control(self) -> EngineClient:
        """The engine, for Control RPCs (served while READY and DRAINING)."""
        if self.engine is None:
            if self.lifecycle is Lifecycle.NOT_READY:
                raise Rejection(grpc.StatusCode.UNAVAILABLE, f"the model failed to load: {self.load_error}")
            raise Rejection(grpc.StatusCode.UNAVAILABLE,
                            "the model is still loading; retry when Health is READY")
        return self.engine

    def engine_for_generate(self) -> EngineClient:
        """The engine, for new Generate requests: only while READY.

        DRAINING refuses with UNAVAILABLE before acceptance (ref, X1: a status, not an
        ``EngineError``, because nothing was accepted; UNAVAILABLE tells clients to retry
        on another instance)."""
        if self.lifecycle is Lifecycle.DRAINING:
            raise Rejection(grpc.StatusCode.UNAVAILABLE, "the server is draining (shutting down); "
                            "retry on another instance")
        if self.engine_error is not None:
            raise Rejection(grpc.StatusCode.UNAVAILABLE, f"{self.engine_error}; retry on another instance")
        return self.engine_for_control()
