"""Consumer side of embedding handles: a request's rows come from its encoder after acceptance.

An accepted request whose media are handles (``Request.awaits_media``) waits outside the
scheduler while ``MediaPulls`` fetches its handles on transfer threads (one part per encoder,
each part one handle at a time):
rows of a host staging arena (``EmbeddingArena``) are taken, the handle's first offered
transfer this engine has ("grpc" or "nixl") copies the encoder's rows into them (the KV
transfer backends, unchanged: a handle is pulled like a KV session whose blocks are rows,
and a successful pull releases the handle on the encoder), the rows are copied out in the
LM's dtype and device, and the staging rows are free again. Between steps the core takes the
finished pulls (``take_finished``): the request is then scheduled, or ended with one fault.
A cancelled pull's end is dropped: its request ended, and its id, reusable from then on, may
already name a new request with a pull of its own.

Failures (ENC13): a handle the encoder no longer holds (released, expired, encoder restarted)
or an unreachable encoder → ``kv_transfer_failed``, not retryable (the unchanged request
names a handle that is gone); a timeout or a corrupt chunk while the encoder may still hold
the handle → retryable, unless another handle of the request was pulled (and so consumed)
before it. Staging rows a READ may still write into are never reused, and are counted: a handle
that no longer fits the rows left fails at once (retryable: on another replica).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from refengine.config import EngineConfig
from refengine.kv.transfer.base import Cancellation, KvTransferBackend, PullOrder, SessionPinner, TransferFailure
from refengine.kv.transfer.nixl_backend import NixlKvTransfer, nixl_available
from refengine.kv.transfer.source_pool import SourcePool, source_of
from refengine.model.embedding_io import EmbeddingArena
from refengine.multimodal.embedding_rows import RowPool
from refengine.types import EmbeddingHandleSpec, EmbeddingTransferSpec, EngineFault, KvSessionSpec

if TYPE_CHECKING:
    from refengine.engine.media import MediaInputs

logger = logging.getLogger(__name__)

Pulled = dict[str, torch.Tensor]  # handle id -> its rows [num_tokens, hidden]


def pull_order(request_id: str, handle: EmbeddingHandleSpec, backends: Mapping[str, object],
               rows: tuple[int, ...], trace: tuple[tuple[str, str], ...] = ()) -> PullOrder:
    """The KV-transfer order that fetches ``handle``'s rows into ``rows``, over its first
    offered transfer this engine has (checked before acceptance)."""
    transfer = _transfer(handle, backends)
    session = KvSessionSpec(handle.handle_id, transfer.backend, transfer.endpoints,
                            attributes={"transfer": dict(transfer.attributes)})
    return PullOrder(request_id, session, 0, rows, trace, content=handle.identity)


def _transfer(handle: EmbeddingHandleSpec, backends: Mapping[str, object]) -> EmbeddingTransferSpec:
    return next(t for t in handle.transfers if t.backend in backends and t.endpoints)


class MediaPulls:
    def __init__(self, backends: Mapping[str, KvTransferBackend], staging: EmbeddingArena, num_threads: int,
                 timeout_seconds: float, on_done: Callable[[], None], dtype: torch.dtype, device: str) -> None:
        self.backends = backends
        self.staging = staging
        self.timeout_seconds = timeout_seconds
        self.dtype, self.device = dtype, device
        self.pulled_bytes = 0
        self.pull_seconds = 0.0
        self._rows = RowPool(staging.num_rows)
        self._rows_freed = threading.Condition()  # guards _rows and _withheld
        self._withheld = 0  # staging rows a READ may still write into: never given out again
        # a hung encoder never takes every thread; a pull that waited its timeout for one fails at once
        self._pool = SourcePool(num_threads, "refengine-media-pull", timeout_seconds, "encoder",
                                "--embedding-pull-timeout")
        self._on_done = on_done
        self._lock = threading.Lock()
        self._keys = itertools.count()
        self._cancel: dict[int, Cancellation] = {}  # the pulls not finished yet, by key
        self._current: dict[str, int] = {}  # request id -> the key of its pull, unless cancelled
        self._finished: list[tuple[str, Pulled | None, EngineFault | None]] = []

    def start(self, request_id: str, handles: Sequence[EmbeddingHandleSpec],
              trace: tuple[tuple[str, str], ...] = ()) -> None:
        unique = list({h.handle_id: h for h in handles}.values())  # a handle used twice is pulled once
        by_source: dict[str, list[EmbeddingHandleSpec]] = {}
        for handle in unique:
            by_source.setdefault(source_of(_transfer(handle, self.backends).endpoints), []).append(handle)
        with self._lock:
            key = next(self._keys)
            pull = _RequestPull(key, request_id, Cancellation(), trace, parts_left=len(by_source))
            self._cancel[key] = pull.cancelled
            self._current[request_id] = key
        # One part per encoder, each within that encoder's share of the threads (found by review:
        # a request with handles on two encoders queued under their combined key, outside the
        # limit of either, so a hung encoder could still hold every thread through such requests).
        for source, part in by_source.items():
            self._pool.submit(source, lambda late, part=part: self._run_part(pull, part, late))

    def cancel(self, request_id: str) -> None:
        """The request ended: stop its pull, and drop its end if the pull already finished (found by
        review: a request ended between steps left that end queued, and a new request reusing the id
        was handed the old rows, or the old failure)."""
        with self._lock:
            event = self._cancel.get(self._current.pop(request_id, -1))
            self._finished = [end for end in self._finished if end[0] != request_id]
        if event is not None:
            event.set()

    def take_finished(self) -> list[tuple[str, Pulled | None, EngineFault | None]]:
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def _run_part(self, pull: _RequestPull, handles: list[EmbeddingHandleSpec], late: TransferFailure | None) -> None:
        """Pull one encoder's handles of a request, one at a time; the last part to end ends the
        request's pull. A part that fails cancels the others: the request fails anyway."""
        failure: TransferFailure | EngineFault | None = None
        try:
            if late is not None:
                raise late
            for handle in handles:
                started = time.perf_counter()
                embeds = self._pull(pull.request_id, handle, pull.cancelled, pull.trace)
                with self._lock:
                    pull.pulled[handle.handle_id] = embeds
                    pull.seconds += time.perf_counter() - started
        except TransferFailure as exc:
            failure = exc
        except Exception as exc:  # a backend bug must still end the request
            logger.exception("media pull of request %s failed", pull.request_id)
            failure = EngineFault("internal", f"embedding pull: {type(exc).__name__}: {exc}", False)
        with self._lock:
            if failure is not None and pull.failure is None:
                pull.failure = failure  # the first: the other parts' "cancelled" follows from it
            pull.parts_left -= 1
            ended = not pull.parts_left
        if failure is not None:
            pull.cancelled.set()
        if ended:
            self._end(pull)

    def _end(self, pull: _RequestPull) -> None:
        """Every part ended: the request's rows, or its one fault (all parts' rows dropped)."""
        fault = pull.failure
        if isinstance(fault, TransferFailure):
            fault = _fault_of(fault, consumed=len(pull.pulled))
        with self._lock:
            if fault is None:
                self.pulled_bytes += sum(t.numel() * t.element_size() for t in pull.pulled.values())
                self.pull_seconds += pull.seconds
            del self._cancel[pull.key]
            if self._current.get(pull.request_id) == pull.key:
                del self._current[pull.request_id]
                self._finished.append((pull.request_id, pull.pulled if fault is None else None, fault))
        self._on_done()

    def _pull(self, request_id: str, handle: EmbeddingHandleSpec, cancelled: Cancellation,
              trace: tuple[tuple[str, str], ...]) -> torch.Tensor:
        """One handle's rows, on the LM's device (the time counted: rows taken to rows copied out)."""
        rows = self._take_rows(handle.num_tokens, cancelled)
        keep_rows = False
        try:
            order = pull_order(request_id, handle, self.backends, rows, trace)
            self.backends[order.session.transfer_backend].pull(order, cancelled)
            embeds = self.staging.get(rows).to(device=self.device, dtype=self.dtype)
            if not bool(torch.isfinite(embeds).all()):  # cheap next to the LM; NaN rows would poison its KV
                raise TransferFailure("failed", f"handle {handle.handle_id!r}: its rows hold NaN or infinity (in "
                                      f"the LM's {self.dtype}), which no encoder produces")
            return embeds
        except TransferFailure as failure:
            keep_rows = failure.dest_may_change
            if keep_rows:
                logger.error("staging rows of handle %s withheld from reuse: %s", handle.handle_id, failure)
            raise
        finally:
            with self._rows_freed:
                if keep_rows:
                    self._withheld += len(rows)
                else:
                    self._rows.free(rows)
                self._rows_freed.notify_all()

    def _take_rows(self, count: int, cancelled: threading.Event) -> tuple[int, ...]:
        if count > self._rows.total_rows:
            raise TransferFailure("failed", f"{count} rows do not fit the {self._rows.total_rows}-row staging "
                                  "memory (--embedding-staging-mib)")
        deadline = time.monotonic() + self.timeout_seconds
        with self._rows_freed:
            while (rows := self._rows.allocate(count)) is None:
                if count > (usable := self._rows.total_rows - self._withheld):
                    raise TransferFailure("failed", f"{count} rows do not fit the {usable} staging rows left "
                                          f"({self._withheld} withheld until restart: a transfer could not stop "
                                          "writing into them): retry on another replica", retryable=True)
                left = deadline - time.monotonic()
                if cancelled.is_set() or left <= 0:
                    raise TransferFailure("failed", "cancelled" if cancelled.is_set() else
                                          "no staging memory came free in time", retryable=True)
                self._rows_freed.wait(min(left, 0.05))
        return rows

    def shutdown(self) -> None:
        """Stop the pulls (each ends once its transfer stopped), then the backends."""
        with self._lock:
            for event in self._cancel.values():
                event.set()
        self._pool.shutdown()
        for backend in self.backends.values():
            backend.close()


@dataclass
class _RequestPull:
    """One request's pull, in one part per encoder; guarded by ``MediaPulls._lock``."""

    key: int
    request_id: str
    cancelled: Cancellation
    trace: tuple[tuple[str, str], ...]
    parts_left: int
    pulled: Pulled = field(default_factory=dict)  # handle id -> rows, over every part
    seconds: float = 0.0
    failure: TransferFailure | EngineFault | None = None  # the first part's that failed


def _fault_of(failure: TransferFailure, consumed: int) -> EngineFault:
    """ENC13's fault. Retryable only while the unchanged request could still succeed: a handle
    pulled before the failure is consumed (released on its encoder), so a retry would find it gone."""
    if consumed and failure.retryable:
        return EngineFault("kv_transfer_failed", f"embedding handle: {failure}; {consumed} handle(s) of this "
                           "request were pulled (consumed) before it, so the same request cannot succeed: encode "
                           "the media again", False)
    return EngineFault("kv_transfer_failed", f"embedding handle: {failure}", failure.retryable)


def make_media_pulls(config: EngineConfig, media: MediaInputs | None, given: Sequence[KvTransferBackend],
                     on_done: Callable[[], None]) -> MediaPulls | None:
    """The pulls of an aggregated or prefill engine with a vision path, over the ``given``
    backends (the server's gRPC one) plus NIXL when it can be imported; None otherwise (such an
    engine refuses handles before acceptance: no transfer it can pull with)."""
    if media is None or config.role not in ("aggregated", "prefill") or not given:
        return None
    backends = {backend.name: backend for backend in given}
    if "nixl" not in backends and nixl_available()[0]:
        pinner = next((b for b in given if isinstance(b, SessionPinner)), None)
        backends["nixl"] = NixlKvTransfer(pinner, pull_timeout_seconds=config.encoder.pull_timeout_seconds)
    expected = media.expectation
    row_nbytes = expected.hidden_size * media.encoder.dtype.itemsize
    staging = EmbeddingArena(max(1, (config.encoder.staging_mib << 20) // row_nbytes), expected.hidden_size,
                             media.encoder.dtype)
    for backend in backends.values():
        backend.bind(staging, lambda handle_id, pulled: None)  # a consumer is never a source
    return MediaPulls(backends, staging, config.encoder.pull_threads, config.encoder.pull_timeout_seconds,
                      on_done, media.encoder.dtype, media.encoder.device)
