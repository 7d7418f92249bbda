"""The engine front end's KV surface: KV events and the prefix cache, KV sessions (prefill
role) and the transfer backends (both disaggregated roles).

A mixin of ``Engine`` (``engine.py``), kept apart to keep each file one idea: it uses the
engine's ``config``, ``core``, ``kv_events``, ``kv_sessions``, ``block_io``, ``_step_lock``
(held by a step), ``_lock`` and ``_stats``. Every method is safe from any thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq

from refengine.config import EngineConfig
from refengine.engine.core import EngineCore, KvEventSink
from refengine.engine.kv_events import KV_EVENTS_DISABLED, KvEventHub, KvEventSubscription
from refengine.kv.transfer.base import KvTransferBackend, SessionPinner, read_identity
from refengine.kv.transfer.nixl_backend import NixlKvTransfer, nixl_available
from refengine.kv.transfer.sessions import KvSessionStore, expecting
from refengine.model.kv_io import KvBlockIO
from refengine.types import EngineStats, FeatureDisabledError, InvalidRequestError, KvEvent


def choose_transfer_backends(config: EngineConfig, given: Seq[KvTransferBackend]) -> dict[str, KvTransferBackend]:
    """The role's transfer backends, not bound yet (none when aggregated). The offered one
    (prefill) comes first; NIXL joins a decode engine, and a prefill engine offering it, when it
    can be imported and the KV cache is in host memory (``--device cpu``). Chosen before the KV
    cache is allocated: a cache NIXL registers goes on huge pages (``model/host_memory.py``);
    ``EngineKvMixin._bind_backends`` then binds them to it."""
    if config.role == "aggregated":
        return {}
    backends = {b.name: b for b in given}
    offered = config.kv_transfer.backend
    if offered == "nixl" and config.device != "cpu":
        raise ValueError(f"--kv-transfer-backend nixl: the KV cache is on {config.device}, and this NIXL backend "
                         "registers host memory only; use --kv-transfer-backend grpc")
    # NIXL reads host memory (it registers "DRAM"): a decode engine with its KV on a GPU pulls over gRPC
    # (found by review: a GPU cache was registered as host memory).
    if "nixl" not in backends and config.device == "cpu" and (config.role == "decode" or offered == "nixl"):
        available, why = nixl_available()
        if available:
            pinner = next((b for b in given if isinstance(b, SessionPinner)), None)  # gRPC pins for NIXL reads
            backends["nixl"] = NixlKvTransfer(pinner, pull_timeout_seconds=config.kv_transfer.pull_timeout_seconds)
        elif offered == "nixl" and config.role == "prefill":
            raise ValueError(f"--kv-transfer-backend nixl: {why}")
    if config.role == "prefill" and offered not in backends:
        raise ValueError(f"the prefill role offers KV over {offered!r}, but this engine has {sorted(backends)}")
    return dict(sorted(backends.items(), key=lambda item: item[0] != offered))


class EngineKvMixin:
    config: EngineConfig
    core: EngineCore
    kv_events: KvEventHub
    kv_sessions: KvSessionStore
    block_io: KvBlockIO
    _step_lock: threading.Lock
    _lock: threading.Condition
    _stats: EngineStats

    def _kv_sink(self, config: EngineConfig, extra: KvEventSink | None) -> KvEventSink | None:
        """The hub, when KV events are on, and ``extra`` (an in-process observer) too."""
        sinks = ([self.kv_events.publish] if config.kv_events.enabled else []) + ([extra] if extra else [])
        if len(sinks) <= 1:
            return sinks[0] if sinks else None

        def both(events: list[KvEvent]) -> None:
            for sink in sinks:
                sink(events)

        return both

    def _bind_backends(self, backends: dict[str, KvTransferBackend]) -> None:
        """Bind ``choose_transfer_backends``' choice to this engine's KV cache."""
        for backend in backends.values():  # a backend's own confirmation follows a pinned READ (NIXL's)
            backend.bind(self.block_io, lambda session_id, pulled: self.confirm_kv_session(session_id, pinned=True)
                         if pulled else self.unpin_kv_session(session_id))
        self._kv_read_identity = read_identity(backends.values())

    # -- KV events and the prefix cache (any thread; each waits for the current step) --
    def subscribe_kv_events(self, on_ready: Callable[[], None], include_snapshot: bool = False,
                            start_sequence_number: int = 0) -> KvEventSubscription:
        """A subscription to the numbered event batches: from a snapshot of the cached
        blocks, or replayed from ``start_sequence_number``, or live from the next batch."""
        if not self.config.kv_events.enabled:
            raise FeatureDisabledError(KV_EVENTS_DISABLED)
        if include_snapshot and start_sequence_number:
            raise InvalidRequestError("include_snapshot and start_sequence_number exclude each other: a snapshot "
                                      "starts a view afresh, a replay continues one")
        with self._step_lock:
            snapshot = self.core.pool.snapshot() if include_snapshot else None
            return self.kv_events.subscribe(on_ready, snapshot, start_sequence_number)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (blocks in use stay) and every cached image encoding, as
        the encoder role does; one ``AllBlocksCleared`` is published at once. Returns how many
        cached blocks were freed."""
        if self.media is not None:
            self.media.cache.clear()
        with self._step_lock:
            freed = self.core.reset_prefix_cache()
            stats = self.core.stats()
        with self._lock:
            self._stats = stats  # an idle engine takes no step that would refresh it
        return freed

    # -- KV sessions (prefill role; any thread) ----------------------------------
    def read_kv_session(self, session_id: str, first_block_index: int, num_blocks: int) -> bytes:
        """Blocks of a live session, read while it cannot be freed (``KvSessionStore``)."""
        block_ids = self.kv_sessions.begin_read(session_id)
        try:
            if first_block_index < 0 or num_blocks < 1 or first_block_index + num_blocks > len(block_ids):
                raise InvalidRequestError(f"blocks {first_block_index}..{first_block_index + num_blocks - 1} are "
                                          f"not in session {session_id!r} ({len(block_ids)} blocks)")
            return self.block_io.read(block_ids[first_block_index:first_block_index + num_blocks])
        finally:
            self.kv_sessions.end_read(session_id)

    def kv_session_content(self, session_id: str) -> str:
        return self.kv_sessions.content(session_id)

    def kv_session_blocks(self, session_id: str) -> int:
        return self.kv_sessions.num_blocks(session_id)

    def block_nbytes(self) -> int:
        return self.block_io.block_nbytes

    def kv_layout(self) -> str:
        return self.block_io.layout

    def pin_kv_session(self, session_id: str, seconds: float, expected_content: str = "") -> tuple[int, ...]:
        return self.kv_sessions.pin(session_id, seconds, expecting(expected_content, self._kv_read_identity))

    def unpin_kv_session(self, session_id: str) -> None:
        self.kv_sessions.unpin(session_id)

    def kv_read_identity(self) -> str:
        return self._kv_read_identity

    def confirm_kv_session(self, session_id: str, pinned: bool = False) -> bool:
        return self.kv_sessions.release(session_id, "pulled", pulled=True, pinned=pinned)

    def abort_kv_session(self, session_id: str) -> bool:
        return self.kv_sessions.release(session_id, "aborted")

    def release_all_kv_sessions(self) -> int:
        return self.kv_sessions.release_all("released by the server")

