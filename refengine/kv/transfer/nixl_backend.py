"""NIXL KV transfer: the decode engine READs a session's blocks straight out of the prefill
engine's registered KV memory (one-sided, NIXL's UCX backend), then notifies the source.

The prefill side offers, in the session's attributes, its agent's metadata, its regions'
addresses and the session's block ids. The decode side loads the metadata, pins the session
(``SessionPinner``: the source takes no part in a READ, only a pin keeps its blocks) while it
reads; once both succeeded it sends ``refengine-release:<session id>`` to the source, whose
notification thread calls ``on_confirmed``; when either failed after the pin was made, it sends
``refengine-unpin:<session id>`` (the pin ends, the session stays offered). Descriptors are
built here from plain numbers (NIXL's serialized ones are pickle). No torch: ``BlockStore``
addresses only; nixl itself is imported lazily (``nixl_available``).
"""

from __future__ import annotations

import base64
import binascii
import functools
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NoReturn

from refengine.kv.transfer.attributes import json_int
from refengine.kv.transfer.base import (
    BlockStore,
    KvRegion,
    KvTransferBackend,
    PullOrder,
    SessionConfirmed,
    SessionPinner,
    TransferFailure,
    pinned_content,
)

logger = logging.getLogger(__name__)

RELEASE_PREFIX = b"refengine-release:"  # + session id: the notification that confirms a pull
UNPIN_PREFIX = b"refengine-unpin:"  # + session id: a pinned pull failed; its pin ends, the session stays
NOTIF_POLL_SECONDS = 0.002  # also how often the source side progresses UCX (TCP's reads need it)
XFER_POLL_SECONDS = 0.0005
XFER_SPIN_SECONDS = 0.005  # a READ still running after transfer() is first polled without sleeping
#: How long a stopped pull (cancelled, timed out, closed) keeps polling its READ. NIXL cannot
#: abort one: release_xfer_handle on a running READ calls UCX's ucp_request_cancel, a no-op for
#: RMA, then ucp_request_free, which only detaches it: its bytes keep landing afterwards.
DRAIN_SECONDS = 10.0


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


@dataclass(frozen=True)
class _Source:
    """A session's source as its attributes describe it (validated)."""

    agent_name: str
    metadata: bytes
    regions: tuple[KvRegion, ...]
    block_ids: tuple[int, ...]


def _fail(message: str, retryable: bool = False, dest_may_change: bool = False) -> TransferFailure:
    return TransferFailure("failed", message, retryable=retryable, dest_may_change=dest_may_change)


def _nixl(what: str, call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)`` with a NIXL error (its own exception types, no common base) as a failure:
    e.g. a vanished peer makes check_xfer_state raise NIXL_ERR_REMOTE_DISCONNECT."""
    try:
        return call(*args)
    except Exception as error:
        raise _fail(f"NIXL could not {what}: {error!r}") from error


def _is_int(value: Any) -> bool:
    return json_int(value) is not None


def _parse_region(value: Any) -> KvRegion:
    """``[address as a decimal string (K9), num_blocks, block_nbytes]``."""
    if not (isinstance(value, list) and len(value) == 3 and isinstance(value[0], str) and value[0].isascii()
            and value[0].isdigit() and _is_int(value[1]) and _is_int(value[2])):
        raise _fail(f"nixl_regions entry {value!r} is not [address string, num_blocks, block_nbytes]")
    if int(value[0]) >= 2**64 or value[1] < 1 or value[2] < 1:
        raise _fail(f"nixl_regions entry {value!r} is out of range")
    return KvRegion(int(value[0]), int(value[1]), int(value[2]))


def _parse_source(attributes: Any) -> _Source:
    """The ``transfer`` attributes that ``source_attributes`` made, checked key by key."""
    if not isinstance(attributes, Mapping):
        raise _fail("the session has no NIXL transfer attributes")
    name, metadata = attributes.get("nixl_agent_name"), attributes.get("nixl_agent_metadata")
    regions, block_ids = attributes.get("nixl_regions"), attributes.get("nixl_block_ids")
    if not (isinstance(name, str) and name and isinstance(metadata, str)
            and isinstance(regions, list) and isinstance(block_ids, list)):
        raise _fail("NIXL transfer attributes need nixl_agent_name, nixl_agent_metadata (strings), "
                    "nixl_regions and nixl_block_ids (lists)")
    if not all(_is_int(b) and b >= 0 for b in block_ids):
        raise _fail("nixl_block_ids must be non-negative integers")
    try:
        raw = base64.b64decode(metadata, validate=True)
    except (binascii.Error, ValueError) as error:
        raise _fail(f"nixl_agent_metadata is not base64: {error}") from None
    return _Source(name, raw, tuple(_parse_region(r) for r in regions), tuple(int(b) for b in block_ids))


def _check_regions(source: _Source, store: BlockStore) -> None:
    """The source's regions match ours: as many, with blocks of the same bytes."""
    if len(source.regions) != len(store.regions):
        raise _fail(f"the source has {len(source.regions)} KV regions, this engine {len(store.regions)}")
    for index, (theirs, mine) in enumerate(zip(source.regions, store.regions, strict=True)):
        if theirs.block_nbytes != mine.block_nbytes:
            raise _fail(f"region {index}: source blocks of {theirs.block_nbytes} bytes, here {mine.block_nbytes}")


def _check_fit(source: _Source, store: BlockStore, order: PullOrder) -> None:
    """The source's regions match ours byte for byte, and the order stays inside both caches."""
    _check_regions(source, store)
    first, count = order.first_block_index, len(order.dest_block_ids)
    if first < 0 or first + count > len(source.block_ids):
        raise _fail(f"blocks {first}..{first + count - 1} requested, the session has {len(source.block_ids)}")
    # max/min once, not per block and region: at 2,048 tokens (128 blocks, 60 regions) that cost 0.44 ms a pull
    if source.block_ids and max(source.block_ids) >= min(r.num_blocks for r in source.regions):
        raise _fail("nixl_block_ids fall outside the source's regions")
    dest = order.dest_block_ids
    if dest and not (min(dest) >= 0 and max(dest) < min(r.num_blocks for r in store.regions)):
        raise _fail("destination block ids fall outside this engine's KV cache")


def _pin_held(pin_outcome: Callable[[], None], failure: TransferFailure) -> bool:
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


def _runs(pairs: Sequence[tuple[int, int]]) -> Iterator[tuple[int, int, int]]:
    """(dest, source, length) of each maximal run of (dest, source) block ids both going up by one."""
    start = 0
    for i in range(1, len(pairs) + 1):
        if i == len(pairs) or pairs[i] != (pairs[i - 1][0] + 1, pairs[i - 1][1] + 1):
            yield pairs[start][0], pairs[start][1], i - start
            start = i


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
        self._remotes: dict[str, bytes] = {}  # remote agent name -> the metadata loaded for it
        self._lock = threading.Condition()  # guards _remotes and _active
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
        self._store = store
        self._registered = self._agent.register_memory(
            [(r.address, r.num_blocks * r.block_nbytes, 0, "") for r in store.regions], "DRAM")
        # after registering: the metadata carries the registered regions' remote keys
        self._metadata_b64 = base64.b64encode(self._agent.get_agent_metadata()).decode("ascii")
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
        try:
            source = _parse_source(transfer)
            if self._store is not None:
                _check_regions(source, self._store)
        except TransferFailure as error:
            return str(error)
        if not source.metadata:
            return "nixl_agent_metadata is empty"
        if len(source.block_ids) != num_blocks:
            return f"{len(source.block_ids)} nixl_block_ids for a session of {num_blocks} blocks"
        if source.block_ids and max(source.block_ids) >= min((r.num_blocks for r in source.regions), default=0):
            return "nixl_block_ids fall outside the source's regions"
        return ""

    def pull(self, order: PullOrder, cancelled: threading.Event) -> None:
        """Validate (before any pin or transfer), then pin and READ at once; see the class docstring."""
        if self._store is None:
            raise RuntimeError("NixlKvTransfer.pull: bind() first")
        source = _parse_source(order.session.attributes.get("transfer"))
        _check_fit(source, self._store, order)
        with self._lock:
            if self._closed.is_set():
                raise _fail("the NIXL backend is closed")
            self._active += 1
        try:
            self._pull(order, source, cancelled)
        finally:
            with self._lock:
                self._active -= 1
                self._lock.notify_all()

    def _pull(self, order: PullOrder, source: _Source, cancelled: threading.Event) -> None:
        deadline = time.monotonic() + self._timeout  # the pin holds the blocks this long from now
        if cancelled.is_set():
            raise _fail("cancelled")
        started = time.perf_counter()
        # The READ overlaps the pin's round trip (see SessionPinner); the release goes only
        # after both, or an early release would make the pin fail.
        content = pinned_content(order.content, source.block_ids) if order.content else ""
        pinner = self._pinner
        pin_outcome = pinner.start_pin(order.session, self._timeout, order.trace, content) if pinner else None
        peer = self._remote(source)
        try:
            if order.dest_block_ids:
                self._read(order, source, peer, cancelled, deadline)
            read = time.perf_counter()
            if pin_outcome is not None:
                pin_outcome()
        except TransferFailure as failure:
            if pin_outcome is not None and _pin_held(pin_outcome, failure):
                self._unpin(peer, order.session.session_id)
            raise
        _nixl("send the release", self._agent.send_notif, peer, RELEASE_PREFIX + order.session.session_id.encode())
        logger.debug("NIXL pull of %d blocks: READ %.2f ms, then pin %.2f ms", len(order.dest_block_ids),
                     (read - started) * 1e3, (time.perf_counter() - read) * 1e3)

    def _unpin(self, peer: str, session_id: str) -> None:
        """End this pull's pin at the source: the source's blocks stay held only by its lease, not
        for the rest of the pin window (a READ of the source's memory only ever writes here)."""
        try:
            self._agent.send_notif(peer, UNPIN_PREFIX + session_id.encode())
        except Exception:  # the pin window still bounds it; the pull's own failure matters more
            logger.exception("NIXL: ending the pin of session %s failed", session_id)

    def _read(self, order: PullOrder, source: _Source, peer: str, cancelled: threading.Event,
              deadline: float) -> None:
        local, remote = _nixl("describe the blocks", self._descriptors, order, source)
        logger.debug("NIXL READ of %d blocks in %d descriptors", len(order.dest_block_ids), local.descCount())
        if cancelled.is_set():
            raise _fail("cancelled")
        handle = _nixl("set up the READ", self._agent.initialize_xfer, "READ", local, remote, peer)
        try:
            self._wait(handle, cancelled, deadline)
        finally:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception:  # its finalizer retries; the pull's own outcome matters more
                logger.exception("releasing a NIXL transfer handle failed")

    def _remote(self, source: _Source) -> str:
        """The source's agent name, its metadata loaded (again, when it changed: NIXL replaces it)."""
        with self._lock:
            if self._remotes.get(source.agent_name) != source.metadata:
                loaded = _nixl("load the source's metadata", self._agent.add_remote_agent, source.metadata)
                loaded = loaded.decode() if isinstance(loaded, bytes) else loaded  # bytes in nixl 1.5
                if loaded != source.agent_name:
                    if self._remotes.pop(loaded, None) is None:  # a peer we use: reloaded next time instead
                        self._forget(loaded)
                    raise _fail(f"the NIXL metadata is agent {loaded!r}'s, not {source.agent_name!r}'s")
                self._remotes[loaded] = source.metadata
        return source.agent_name

    def _forget(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception:  # already gone: nothing left to remove
            logger.debug("removing NIXL agent %s failed", name, exc_info=True)

    def _descriptors(self, order: PullOrder, source: _Source) -> tuple[Any, Any]:
        """Local and remote descriptor lists, pairwise equal in length: one per run and region."""
        assert self._store is not None
        first = order.first_block_index
        pairs = [(d, source.block_ids[first + i]) for i, d in enumerate(order.dest_block_ids)]
        local, remote = [], []
        for dest, src, length in _runs(pairs):
            for mine, theirs in zip(self._store.regions, source.regions, strict=True):
                size = length * mine.block_nbytes
                local.append((mine.address + dest * mine.block_nbytes, size, 0))
                remote.append((theirs.address + src * theirs.block_nbytes, size, 0))
        return self._agent.get_xfer_descs(local, "DRAM"), self._agent.get_xfer_descs(remote, "DRAM")

    def _wait(self, handle: Any, cancelled: threading.Event, deadline: float) -> None:
        state = _nixl("post the READ", self._agent.transfer, handle)  # over CMA, the whole copy is here
        spin_until = time.monotonic() + XFER_SPIN_SECONDS
        while state == "PROC":
            stopped = cancelled.is_set() or self._closed.is_set()
            if stopped or time.monotonic() > deadline:
                self._stop(handle, stopped)
            if time.monotonic() < spin_until:
                time.sleep(0)  # a short READ ends within microseconds: poll at once (GIL released)
            else:
                cancelled.wait(XFER_POLL_SECONDS)
            state = _nixl("check the READ", self._agent.check_xfer_state, handle)
        if state != "DONE":
            raise _fail("the NIXL READ failed")

    def _stop(self, handle: Any, cancelled: bool) -> NoReturn:
        """Drain a stopped READ, then fail. Even one that ends while draining past the deadline
        is no success: its last bytes were read after the pin ran out."""
        state = self._drain(handle)
        late = ": the READ still runs, its destination blocks may still change" if state == "PROC" else ""
        if cancelled:
            raise _fail("cancelled" + late, dest_may_change=bool(late))
        # no release was sent: the source may still hold the session
        raise _fail(f"timed out after {self._timeout:g} s{late}", retryable=True, dest_may_change=bool(late))

    def _drain(self, handle: Any) -> str:
        """Poll a stopped READ until it is no longer in progress, at most ``DRAIN_SECONDS``."""
        end = time.monotonic() + DRAIN_SECONDS
        while time.monotonic() < end:
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception:  # the request ended in an error: nothing of it is pending
                return "ERR"
            if state != "PROC":
                return state
            time.sleep(XFER_POLL_SECONDS)
        logger.error("a NIXL READ still runs %g s after it was stopped: its blocks may still change", DRAIN_SECONDS)
        return "PROC"

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
        for name in list(self._remotes):
            self._forget(name)
        self._remotes.clear()
        if self._registered is not None:
            self._agent.deregister_memory(self._registered)
        self._agent = self._registered = None
