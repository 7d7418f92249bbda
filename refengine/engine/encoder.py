"""The encoder role (draft profile ``encoder``, docs/profiles/encoder.md): media in, leased
embedding handles out. No language model, no KV cache, no Generate.

``encode`` (any thread): every item is decoded under the media policy (``sources.py``, the
same refusals as ``GenerateRequest.media``), identities not in the encoder cache are encoded in
one batch (``MediaInputs.encode_images``; a uuid given to two images names the first), and each
item gets a handle on rows of the embedding arena (``EmbeddingArena``) under a lease. All or
nothing: a refusal, or no room, leaves nothing held (ENC3, ENC4).

Handles are the KV sessions of this engine (``KvSessionStore``: a session's blocks are the
handle's rows, its ``content`` the media identity), so the KV pull service and the NIXL
backend serve them unchanged, and a session's rules hold: its rows never change while it is
live or read, and a due handle (released, consumed by a pull, or past its lease, and not
being read) drops its hold on the rows (``EmbeddingEntries``: rows no handle holds stay
cached for the next Encode of the same media, until evicted). A sweeper thread frees handles
whose lease ends; the release paths free at once.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import replace

import torch
from PIL import Image

from refengine.config import EngineConfig
from refengine.engine.encoder_sessions import HandleSessions
from refengine.engine.info import configured_context, engine_info
from refengine.engine.interface import EngineInfo
from refengine.engine.media import MediaInputs, salted
from refengine.engine.no_generate import NoGenerate
from refengine.engine.validation import validate_encode
from refengine.kv.transfer.base import KvTransferBackend
from refengine.kv.transfer.nixl_backend import NixlKvTransfer, nixl_available
from refengine.kv.transfer.sessions import KvSession, KvSessionStore
from refengine.model.embedding_io import EmbeddingArena
from refengine.multimodal.embedding_rows import EmbeddingEntries, RowPool
from refengine.multimodal.handles import split_identity
from refengine.multimodal.sources import LoadedImage
from refengine.types import (
    EmbeddingHandleSpec,
    EmbeddingTransferSpec,
    EngineStats,
    InvalidRequestError,
    KvSessionNotFound,
    MediaInput,
    MediaStats,
    OverloadedError,
)

logger = logging.getLogger(__name__)


class EncoderEngine(HandleSessions, NoGenerate):
    def __init__(self, config: EngineConfig, media: MediaInputs, info: EngineInfo,
                 transfer_backends: Sequence[KvTransferBackend] = ()) -> None:
        self.config = config
        self.media = media
        expected = media.expectation
        self.expectation = expected
        row_nbytes = expected.hidden_size * media.encoder.dtype.itemsize
        self.arena = EmbeddingArena(max(1, (config.encoder.memory_mib << 20) // row_nbytes), expected.hidden_size,
                                    media.encoder.dtype)
        self._lock = threading.Lock()  # guards entries, _entry_keys and the arena's rows being written
        self._entry_keys: dict[str, str] = {}  # handle id -> the cache entry it holds (its identity, salted)
        self.entries = EmbeddingEntries(RowPool(self.arena.num_rows), config.encoder.max_cached_entries)
        self._sweep = threading.Condition()
        self.handles = KvSessionStore(on_change=self._wake_sweeper)
        self.backends = self._bind(transfer_backends)
        self.info = replace(info, kv_transfer_backends=tuple(self.backends))
        self._stopping = False
        self._sweeper: threading.Thread | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, transfer_backends: Sequence[KvTransferBackend] = ()) -> EncoderEngine:
        """Load only the vision tower, the projector and the image processor of ``config.model``."""
        from refengine.model import devices, loader
        from refengine.model.dtypes import DTYPES
        from refengine.model.vision import VISION_PREFIXES

        devices.resolve_device(config.device)  # a missing GPU fails now, not after the weights load
        resolved = loader.resolve_model(config.model)
        model_config, dtype = loader.load_model_config(resolved.path), DTYPES[config.dtype]
        weights = loader.load_weights(resolved.path, dtype, prefixes=VISION_PREFIXES)
        media = MediaInputs.from_model(resolved.path, model_config, weights, dtype, config.device, config.media)
        if media is None:
            raise ValueError(f"--role encoder needs a multimodal model; {config.model} has no vision_config")
        name = config.served_model_name or resolved.name
        max_model_len = configured_context(config, model_config)
        info = engine_info(config, model_config, name, max_model_len, 0, multimodal=True)
        return cls(config, media, replace(info, guided_modes=(), max_num_seqs=0, max_num_batched_tokens=0,
                                          max_sequences_per_request=0, eos_token_ids=()), transfer_backends)

    def _bind(self, given: Sequence[KvTransferBackend]) -> dict[str, KvTransferBackend]:
        """The gRPC pull always; NIXL too when it is the configured backend (offered first then)."""
        backends = {b.name: b for b in given}
        if self.config.kv_transfer.backend == "nixl" and "nixl" not in backends:
            available, why = nixl_available()
            if not available:
                raise ValueError(f"--kv-transfer-backend nixl: {why}")
            backends["nixl"] = NixlKvTransfer(None)
        offered = self.config.kv_transfer.backend
        ordered = dict(sorted(backends.items(), key=lambda item: item[0] != offered))
        for backend in ordered.values():
            backend.bind(self.arena, lambda handle_id, pulled: self.confirm_kv_session(handle_id, pinned=True)
                         if pulled else self.unpin_kv_session(handle_id))  # NIXL's
        return ordered

    # -- the Media service -------------------------------------------------------
    def encode(self, items: Sequence[MediaInput], lease_seconds: float | None = None,
               cache_salt: str = "") -> list[EmbeddingHandleSpec]:
        """One handle per item, in order (see the module docstring); with ``cache_salt``, cache
        entries of that salt only. Raises ``InvalidRequestError`` for bad media or lease,
        ``OverloadedError`` when the arena has no room."""
        validate_encode(len(items), self.config.media.max_items, cache_salt)
        lease = self._lease(lease_seconds)
        data = self.media.fetch(items)
        with self.media.decoding:  # from decoded to encoded: the pixels' memory is bounded
            return self._encode_and_hold(self.media.decode(items, data), lease, cache_salt)

    def _encode_and_hold(self, images: list[LoadedImage], lease: float, cache_salt: str) -> list[EmbeddingHandleSpec]:
        identities = [salted(image.identity, cache_salt) for image in images]  # the entries' keys
        with self._lock:
            hits = [self.entries.acquire(identity) for identity in identities]
        held = [identity for identity, rows in zip(identities, hits, strict=True) if rows is not None]
        try:
            missing = {i: images[identities.index(i)] for i, rows in zip(identities, hits, strict=True) if rows is None}
            encoded = self.media.encode_images(list(missing.values())) if missing else None
            self._check_fits({i: len(rows) for i, rows in zip(identities, hits, strict=True) if rows is not None}
                             | {identity: encoded[index].shape[0] for index, identity in enumerate(missing)})
            with self._lock:
                rows_of = {i: rows for i, rows in zip(identities, hits, strict=True) if rows is not None}
                for index, identity in enumerate(missing):
                    rows_of[identity] = self._store(identity, encoded[index])
                    held.append(identity)
                for i, rows in enumerate(hits):  # a second miss of one identity in this request
                    if rows is None and identities.index(identities[i]) != i:
                        self.entries.acquire(identities[i], count_lookup=False)
                        held.append(identities[i])
        except BaseException:
            with self._lock:
                for identity in held:
                    self.entries.drop(identity)
            raise
        handles = self._make_handles(identities, [image.identity for image in images],
                                     [rows_of[identity] for identity in identities],
                                     [rows is not None for rows in hits], lease)
        self._wake_sweeper()  # its wait now ends at the first of these leases
        return handles

    def _make_handles(self, keys: list[str], identities: list[str], rows: list[tuple[int, ...]], cached: list[bool],
                      lease: float) -> list[EmbeddingHandleSpec]:
        """One handle per item, each taking over one of the item's holds; all or nothing (ENC3):
        when one cannot be made, the handles made are released and the other holds dropped, so
        nothing stays held by a handle no client knows of."""
        handles: list[EmbeddingHandleSpec] = []
        try:
            for key, identity, item_rows, hit in zip(keys, identities, rows, cached, strict=True):
                handles.append(self._new_handle(key, identity, item_rows, hit, lease))
        except BaseException:
            self.release_handles([handle.handle_id for handle in handles])
            with self._lock:
                for key in keys[len(handles):]:
                    self.entries.drop(key)
            raise
        return handles

    def _check_fits(self, rows_of: dict[str, int]) -> None:
        """A request whose distinct images need more rows than the whole arena can never be
        held: INVALID_ARGUMENT, not a "retry later" that every retry repeats (found by review)."""
        needed = sum(rows_of.values())
        if needed > self.arena.num_rows:
            raise InvalidRequestError(f"the request's {len(rows_of)} distinct media items need {needed} embedding "
                                      f"rows; this encoder holds {self.arena.num_rows} in all (--encoder-memory-mib)")

    def _store(self, identity: str, values: torch.Tensor) -> tuple[int, ...]:
        """Lock held: rows holding ``values`` for ``identity`` (another Encode's, when it stored
        them meanwhile). Written before the lock is let go, so no handle ever sees them unwritten."""
        rows = self.entries.acquire(identity, count_lookup=False)
        if rows is not None:
            return rows
        rows = self.entries.add(identity, values.shape[0])
        if rows is None:
            raise OverloadedError(f"the encoder's embedding memory is full ({self.entries.held_rows} of its "
                                  f"{self.arena.num_rows} rows held by live handles); release handles or retry later")
        self.arena.put(rows, values)
        return rows

    def _new_handle(self, key: str, identity: str, rows: tuple[int, ...], cached: bool,
                    lease: float) -> EmbeddingHandleSpec:
        handle_id = secrets.token_hex(16)
        # the transfers first: the handle exists (and owns its hold on the rows) only once nothing can fail
        transfers = tuple(EmbeddingTransferSpec(name, (), backend.source_attributes(handle_id, rows))
                          for name, backend in self.backends.items())
        with self._lock:
            self._entry_keys[handle_id] = key
        self.handles.add(KvSession(handle_id, identity, rows, time.monotonic() + lease))
        mm_hash, algorithm = split_identity(identity)
        expected = self.expectation
        return EmbeddingHandleSpec(handle_id, mm_hash, algorithm, "image", (len(rows), expected.hidden_size),
                                   expected.dtype, expected.layout, expected.fingerprint, transfers,
                                   time.time_ns() + int(lease * 1e9), cached)

    def _lease(self, seconds: float | None) -> float:
        settings = self.config.encoder
        if seconds is None:
            return settings.lease_seconds
        if not math.isfinite(seconds) or seconds <= 0:
            raise InvalidRequestError(f"lease_seconds must be a positive finite number, got {seconds}")
        return min(seconds, settings.max_lease_seconds)

    def probe(self) -> bool:
        """Encode one small image, bypassing the cache and making no handle (the health probe).
        False, at once, when an encode is running: the probe neither waits for it nor holds a
        worker thread that the server's other RPCs (KvPull reads) need."""
        image = Image.new("RGB", (8, 8), (255, 255, 255))
        return self.media.encode_images([LoadedImage(image, "probe", 0, "PNG")], wait=False) is not None

    def release_handles(self, handle_ids: Sequence[str]) -> int:
        """Release each live handle (ENC6: idempotent); returns how many were live."""
        released = sum(self.handles.release(handle_id, "released") for handle_id in handle_ids)
        self._free_due()
        return released

    def renew_handle(self, handle_id: str, lease_seconds: float) -> int:
        """A live handle's new lease end (Unix nanoseconds); raises ``KvSessionNotFound``."""
        lease = self._lease(lease_seconds)
        try:
            self.handles.renew(handle_id, lease)
        except KvSessionNotFound:
            raise KvSessionNotFound(f"embedding handle {handle_id!r} not found: released, consumed, expired or "
                                    "never made here") from None
        return time.time_ns() + int(lease * 1e9)

    # -- freeing -------------------------------------------------------------------
    def _free_due(self) -> None:
        due = self.handles.take_due()
        if due:
            with self._lock:
                for handle in due:
                    self.entries.drop(self._entry_keys.pop(handle.session_id))

    def _wake_sweeper(self) -> None:
        with self._sweep:
            self._sweep.notify_all()

    def _sweep_loop(self) -> None:
        with self._sweep:
            while not self._stopping:
                self._sweep.wait(self.handles.seconds_until_due())
                try:
                    self._free_due()
                except Exception:  # a sweeper that died would leave every later lease unenforced
                    logger.exception("freeing expired embedding handles failed; retrying on the next wake")

    def check_integrity(self) -> None:
        with self._lock:
            self.entries.check()

    def media_stats(self) -> MediaStats:
        with self._lock:
            return MediaStats(held_handles=len(self.handles), held_rows=self.entries.held_rows,
                              cached_rows=self.entries.cached_rows, free_rows=self.entries.pool.num_free,
                              total_rows=self.arena.num_rows, cached_entries=self.entries.num_cached,
                              cache_hits=self.entries.hits, cache_misses=self.entries.misses)

    # -- EngineClient: handles as KV sessions (the rest: ``NoGenerate``) ----------------
    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0, 0, 0, 0, 0, 0, 0, active_kv_sessions=0, media=self.media_stats())

    def reset_prefix_cache(self) -> int:
        """Forget the encoder cache: entries no handle holds are freed. Returns their rows."""
        with self._lock:
            freed = self.entries.cached_rows
            self.entries.evict_cached()
        return freed

    def start(self) -> None:
        if self._sweeper is None:
            self._sweeper = threading.Thread(target=self._sweep_loop, name="refengine-handle-sweeper", daemon=True)
            self._sweeper.start()

    def shutdown(self) -> None:
        with self._sweep:
            self._stopping = True
            self._sweep.notify_all()
        if self._sweeper is not None:
            self._sweeper.join()
            self._sweeper = None
        for backend in self.backends.values():
            backend.close()

