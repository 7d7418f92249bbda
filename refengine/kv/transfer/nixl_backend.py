"""NIXL KV transfer: the decode engine READs a session's blocks straight out of the prefill
engine's registered KV memory (one-sided, NIXL's UCX backend), then notifies the source.

The prefill side offers, in the session's attributes, its agent's metadata, its regions'
addresses and the session's block ids. The decode side loads the metadata, pins the session
(``SessionPinner``: the source takes no part in a READ, only a pin keeps its blocks) while it
reads; once both succeeded it sends ``refengine-release:<session id>`` to the source, whose
notification thread calls ``on_confirmed``; when either failed after the pin was made, it sends
``refengine-unpin:<session id>`` (the pin ends, the session stays offered). Descriptors are
built from plain numbers (nixl_source.py; NIXL's serialized ones are pickle), and a READ is waited
for in nixl_read.py. No torch: ``BlockStore`` addresses only; nixl itself is imported lazily
(``nixl_available``).
"""

from __future__ import annotations

import base64
import functools
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from refengine.kv.transfer.base import (
    BlockStore,
    Cancellation,
    KvTransferBackend,
    PullOrder,
    SessionConfirmed,
    SessionPinner,
    TransferFailure,
    pinned_content,
)
from refengine.kv.transfer.nixl_read import DRAIN_SECONDS, nixl_call, wait_read
from refengine.kv.transfer.nixl_remotes import RemoteAgents
from refengine.kv.transfer.nixl_source import (
    NixlSource,
    check_fit,
    descriptor_ranges,
    fail,
    parse_source,
    source_identity,
    source_problem,
)

logger = logging.getLogger(__name__)

RELEASE_PREFIX = b"refengine-release:"  # + session id: the notification that confirms a pull
UNPIN_PREFIX = b"refengine-unpin:"  # + session id: a pinned pull failed; its pin ends, the session stays
NOTIF_POLL_SECONDS = 0.002  # also how often the source side progresses UCX (TCP's reads need it)


def _nixl_api() -> ModuleType:
    try:  # nixl_cu12 directly: the ``nixl`` meta package refuses to import next to a CUDA-13 torch
        from nixl_cu12 import _api
    except ImportError:
        from nixl import _api
    return _api


@functools.cache
def nixl_available() -> tuple[bool, str]:
    """(True, "") when NIXL can be imported, else (False, why)."""
    try:
        _nixl_api()
    except Exception as error:  # ImportError, or the meta package's RuntimeError about CUDA
        return False, f"nixl cannot be imported: {error!r}"
    return True, ""


def _pin_held(pin_outcome: Callable[[], float], failure: TransferFailure) -> bool:
    """Whether the source holds this failed pull's pin: its content check failed after it was
    made, or the READ failed and the pin (waited for now) was made."""
    if failure.pin_held:
        return True
    try:
        pin_outcome()
    except TransferFailure as pin_failure:
        return pin_failure.pin_held
    except Exception:  # the pin's RPC broke: no pin to end as far as we know
        return False
    return True


def _check_read_within_pin(read_ended: float, held_until: float) -> None:
    """A READ that ended after the pin's window (the source grants at most its own
    --kv-pull-timeout, whatever this side asked) may have read blocks the source had freed and
    reused by then: its data is not trusted (K10; found by review: a prefill with a shorter
    timeout than the decode's let a late READ count). Both times are ``time.monotonic()``."""
    late = read_ended - held_until
    if late > 0:
        raise fail(f"the READ ended {late:.3f} s after the source's pin of its blocks did", retryable=True)


class NixlKvTransfer(KvTransferBackend):
    """Prefill side: registers the KV cache, confirms the sessions NIXL reports read. Decode side:
    ``pull`` READs into destination blocks, from any number of threads at once.

    ``pull`` returns or raises only once its READ is no longer in progress (done, failed, or
    drained after a stop), except a READ still running ``DRAIN_SECONDS`` after a stop: that
    one is logged, and the failure's message says its destination blocks may still change."""

    name = "nixl"
    protocol = "nixl"

    def __init__(self, pinner: SessionPinner | None, agent_name: str | None = None,
                 pull_timeout_seconds: float = 30.0) -> None:
        self._pinner = pinner
        self.agent_name = agent_name or f"refengine-{os.getpid()}-{secrets.token_hex(6)}"
        self._timeout = pull_timeout_seconds
        self._agent: Any = None  # the nixl_agent, once bound
        self._store: BlockStore | None = None
        self._registered: Any = None
        self._metadata_b64 = ""
        self._remotes: RemoteAgents | None = None  # the agents READ from, once bound
        self._lock = threading.Condition()  # guards _active and the notification thread's start
        self._active = 0  # pulls running: close waits for them
        self._closed = threading.Event()
        self._notif_thread: threading.Thread | None = None  # from the first source_attributes
        self._on_confirmed: SessionConfirmed = lambda session_id, pulled: None

    def bind(self, store: BlockStore, on_confirmed: SessionConfirmed) -> None:
        api = _nixl_api()
        # No progress thread: nixl's runs with no delay and spins a core per agent for good (3x
        # slower pulls on 2 cores); the polls below progress UCX. STRICT: the notification thread,
        # the transfer threads and close share the agent.
        config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                       sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self._agent = api.nixl_agent(self.agent_name, config)
        if "UCX" not in self._agent.backends:  # nixl_agent only warns about a missing plugin
            raise RuntimeError("NIXL has no UCX plugin: cannot transfer KV")
        self._remotes = RemoteAgents(self._agent)
        self._store = store
        self._registered = self._agent.register_memory(
            [(r.address, r.num_blocks * r.block_nbytes, 0, "") for r in store.regions], "DRAM")
        # after registering: the metadata carries the registered regions' remote keys
        metadata = self._agent.get_agent_metadata()
        self._metadata_b64 = base64.b64encode(metadata).decode("ascii")
        self.read_identity = source_identity(self.agent_name, metadata, store.regions)
        self._on_confirmed = on_confirmed

    def _watch_once(self) -> None:
        """Start polling notifications with the first session offered: only a source receives
        them, and on a decode engine the polls would only take the GIL from its other threads."""
        with self._lock:
            if self._notif_thread is None:
                self._notif_thread = threading.Thread(target=self._watch_notifs, args=(self._on_confirmed,),
                                                      name=f"nixl-notifs-{self.agent_name}", daemon=True)
                self._notif_thread.start()

    def _watch_notifs(self, on_confirmed: SessionConfirmed) -> None:
        while not self._closed.wait(NOTIF_POLL_SECONDS):
            try:
                notifs = self._agent.get_new_notifs()
            except Exception:  # NIXL's own exception types
                logger.exception("NIXL get_new_notifs failed")
                continue
            for peer, messages in notifs.items():
                for message in messages:
                    self._confirm(peer, message, on_confirmed)

    @staticmethod
    def _confirm(peer: str, message: bytes, on_confirmed: SessionConfirmed) -> None:
        prefix = next((p for p in (RELEASE_PREFIX, UNPIN_PREFIX) if message.startswith(p)), b"")
        try:
            session_id = message.removeprefix(prefix).decode() if prefix else ""
        except UnicodeDecodeError:
            session_id = ""
        if not session_id:
            logger.debug("ignoring NIXL notification %r from %s", message[:64], peer)
            return
        try:
            on_confirmed(session_id, prefix == RELEASE_PREFIX)
        except Exception:  # the thread must outlive a failing callback, or no session is released again
            logger.exception("on_confirmed(%r) failed", session_id)

    def source_attributes(self, session_id: str, block_ids: Sequence[int]) -> dict[str, Any]:
        store = self._store
        if store is None or self._closed.is_set():
            raise RuntimeError("NixlKvTransfer.source_attributes: not bound, or closed")
        self._watch_once()
        return {"nixl_agent_name": self.agent_name, "nixl_agent_metadata": self._metadata_b64,
                "nixl_regions": [[str(r.address), r.num_blocks, r.block_nbytes] for r in store.regions],
                "nixl_block_ids": [int(b) for b in block_ids]}

    def source_problem(self, transfer: Mapping[str, Any], num_blocks: int) -> str:
        return source_problem(transfer, num_blocks, self._store)

    def pull(self, order: PullOrder, cancelled: Cancellation) -> None:
        """Validate (before any pin or transfer), then pin and READ at once; see the class docstring."""
        if self._store is None or self._remotes is None:
            raise RuntimeError("NixlKvTransfer.pull: bind() first")
        source = parse_source(order.session.attributes.get("transfer"))
        check_fit(source, self._store, order)
        with self._lock:
            if self._closed.is_set():
                raise fail("the NIXL backend is closed")
            self._active += 1
        try:
            self._pull(order, source, cancelled)
        finally:
            with self._lock:
                self._active -= 1
                self._lock.notify_all()

    def _pull(self, order: PullOrder, source: NixlSource, cancelled: Cancellation) -> None:
        assert self._remotes is not None
        deadline = time.monotonic() + self._timeout  # the pin holds the blocks this long from now
        if cancelled.is_set():
            raise fail("cancelled")
        started = time.perf_counter()
        # The READ overlaps the pin's round trip (see SessionPinner); the release goes only
        # after both, or an early release would make the pin fail.
        # the pin succeeds only if the source holds this content in these blocks of the memory
        # this READ reads: an agent the request named that is not the pinned server's fails it
        read_from = source_identity(source.agent_name, source.metadata, source.regions)
        content = pinned_content(order.content, source.block_ids, read_from) if order.content else ""
        pinner = self._pinner
        pin_outcome = pinner.start_pin(order.session, self._timeout, order.trace, content,
                                       cancelled) if pinner else None
        # A source no pin has vouched for is not dialled before its pin does (found by review: a
        # handle naming a made-up agent had this side connect to it and READ before the pin
        # refused it): a source's first pull waits the pin's round trip, later ones overlap it.
        pin_first = pin_outcome is not None and bool(content) and not self._remotes.vouched(read_from)
        peer, held_until = None, math.inf  # until when the pin surely holds the source's blocks
        try:
            try:
                if pin_first:
                    held_until = pin_outcome()
                peer = self._remotes.use(source)
                if order.dest_block_ids:
                    self._read(order, source, peer, cancelled, min(deadline, held_until))
                read, read_ended = time.perf_counter(), time.monotonic()
                if pin_outcome is not None and not pin_first:
                    held_until = pin_outcome()
                _check_read_within_pin(read_ended, held_until)
            except TransferFailure as failure:
                # A held pin of an agent never loaded (its first pin said the source holds other
                # content) is not ended here: that would dial the agent the pin just disowned. Only a
                # source ignoring PinRequest.expected_content pins then (refengine's refuses, making
                # no pin); its pin window ends it.
                if peer is not None and pin_outcome is not None and _pin_held(pin_outcome, failure):
                    self._unpin(peer, order.session.session_id)
                raise
            if content:
                self._remotes.vouch(read_from)
            nixl_call("send the release", self._agent.send_notif, peer,
                      RELEASE_PREFIX + order.session.session_id.encode())
        finally:
            if peer is not None:  # another pull may forget the agent now
                self._remotes.done_with(peer)
        logger.debug("NIXL pull of %d blocks: READ %.2f ms, then pin %.2f ms", len(order.dest_block_ids),
                     (read - started) * 1e3, (time.perf_counter() - read) * 1e3)

    def _unpin(self, peer: str, session_id: str) -> None:
        """End this pull's pin at the source: the source's blocks stay held only by its lease, not
        for the rest of the pin window (a READ of the source's memory only ever writes here)."""
        try:
            self._agent.send_notif(peer, UNPIN_PREFIX + session_id.encode())
        except Exception:  # the pin window still bounds it; the pull's own failure matters more
            logger.exception("NIXL: ending the pin of session %s failed", session_id)

    def _read(self, order: PullOrder, source: NixlSource, peer: str, cancelled: Cancellation,
              deadline: float) -> None:
        local, remote = nixl_call("describe the blocks", self._descriptors, order, source)
        logger.debug("NIXL READ of %d blocks in %d descriptors", len(order.dest_block_ids), local.descCount())
        if cancelled.is_set():
            raise fail("cancelled")
        handle = nixl_call("set up the READ", self._agent.initialize_xfer, "READ", local, remote, peer)
        try:
            wait_read(self._agent, handle, cancelled, self._closed, deadline, self._timeout)
        finally:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception:  # its finalizer retries; the pull's own outcome matters more
                logger.exception("releasing a NIXL transfer handle failed")

    def _descriptors(self, order: PullOrder, source: NixlSource) -> tuple[Any, Any]:
        assert self._store is not None
        local, remote = descriptor_ranges(order, source, self._store)
        return self._agent.get_xfer_descs(local, "DRAM"), self._agent.get_xfer_descs(remote, "DRAM")

    def close(self) -> None:
        """Stop pulls (they drain first) and the notification thread, then unregister. Idempotent."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            self._lock.wait_for(lambda: self._active == 0, timeout=self._timeout + DRAIN_SECONDS)
        if self._notif_thread is not None:
            self._notif_thread.join()
        if self._agent is None:
            return
        if self._remotes is not None:
            self._remotes.forget_all()
        if self._registered is not None:
            self._agent.deregister_memory(self._registered)
        self._agent = self._registered = None
