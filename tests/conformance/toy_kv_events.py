"""The toy server with KV events (section E): a Control that serves them from refengine's own
``KvEventHub``. Each Generate stores its prompt's full blocks (4 ASCII tokens each; an image's
positions as tests/conformance/toy_media.py expands them) that are not cached yet, as one batch,
evicting the least recently used blocks first when the cache (``TOTAL_BLOCKS``, as ServerInfo
reports it) is full; ``KvFaults`` break the section-E rules on purpose.
"""

from __future__ import annotations

import socket
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import grpc

from refengine.engine.kv_events import KvEventHub
from refengine.kv.keys import block_keys
from refengine.kv.prefix_hash import MediaSpan, block_extra_keys
from refengine.protocol import oe
from refengine.server.kv_events_wire import batch_response
from refengine.types import BlockRemoved, BlockStored
from tests.conformance.fake_server import TOTAL_BLOCKS, Control, Inference, start
from tests.conformance.toy_engine import BLOCK, ToyEngine
from tests.conformance.toy_faults import Faults
from tests.conformance.toy_media import PLACEHOLDER, requested


@dataclass(frozen=True)
class KvFaults:
    """Deliberate violations of section E (all off = a conforming server).

    ``lagging`` and ``staggered`` are not faults (RULES set no latency bound). With ``staggered``
    the gap between a step's first batch and the rest is longer than the 0.3 s that E3 and E4
    once waited after a request's first batch, so a check judging such a window fails that
    stream without CPU load too (with every batch 0.5 s late, E3 failed only in CI, under load);
    E1's retained replay, which sent more requests than it needed, replayed a batch the negative
    controls' 8-batch window no longer held. The lagging-event-stream control uses it."""

    retained: int = 1000  # batches kept for replay
    repeat_numbers: bool = False  # E1: every batch carries the previous batch's number
    gap: bool = False  # E2: a number is skipped before every batch
    partial_blocks: bool = False  # E3: a prompt's trailing partial block is stored too
    silent_eviction: bool = False  # E3: evicted blocks get no BlockRemoved
    announce_once: bool = False  # E3: a block evicted and computed again is cached but not stored again
    empty_snapshot: bool = False  # E2: include_snapshot sends an empty first batch
    leafless_snapshot: bool = False  # E2: the snapshot leaves out every block no cached block chains onto
    salt_ignored: bool = False  # E4: the cache salt is not in the block hash
    orphans: bool = False  # E4: a prompt's first block is never stored, its children are
    parent_in_batch_only: bool = False  # E4: a block names its parent only when both are stored in one batch
    status_on_failure: bool = False  # E5: a replay that cannot be served ends with a status, no error event
    status_on_expired: bool = False  # E5: only a replay from an expired number ends with a bare status
    silent_expired: bool = False  # E1: an expired replay starts at the oldest retained batch, no error
    replay_skips_first: bool = False  # E1: a replay from a retained number starts one batch later
    wildcard_host: bool = False  # E6: a source advertises 0.0.0.0
    unconnectable_source: bool = False  # E6: the advertised port has no listener
    accept_bad_ranks: bool = False  # E6: unknown and repeated ranks are accepted
    no_sources: bool = False  # not a fault (E6 not claimed): no event publisher, so no source listed at all
    no_source_for_a_rank: bool = False  # E6: the source is listed for all ranks, none when rank 0 is asked for
    lagging: bool = False  # not a fault: stored blocks published 16 a batch, each delivered 0.5 s after
    staggered: bool = False  # not a fault: as ``lagging``, and a step's later batches 0.5 s after its first
    lag_seconds: float = 0.5  # how late ``lagging`` delivers a batch (``staggered``'s later batches: twice that)
    bare_blocks: bool = False  # not a fault: BlockStored without token_ids and block_size (both optional)
    image_ids_hidden: bool = False  # not a fault: BlockStored's token_ids carry 0 at an image's positions


def _batches(removed: list, stored: list, per_batch: int) -> list[list]:
    """One step's events as the batches published: the removals, then ``per_batch`` stored blocks a batch."""
    parts = [stored[i:i + per_batch] for i in range(0, len(stored), per_batch)] or [[]]
    return [removed + parts[0], *parts[1:]]


class ToyKvCache:
    """The toy's prefix cache: published blocks, least recently used first, and the hub that numbers batches."""

    def __init__(self, faults: KvFaults) -> None:
        self.faults = faults
        self.hub = KvEventHub(faults.retained, subscriber_buffer=1024)
        self.lock = threading.Lock()
        self.published: OrderedDict[bytes, BlockStored] = OrderedDict()
        self.ever_published: set[bytes] = set()
        self.later_batches: set[int] = set()  # the numbers of batches that are not their step's first

    def store_prompt(self, token_ids: list[int], salt: str, lora_name: str, images: list[MediaSpan]) -> None:
        extra = ("toy",) + ((f"salt:{salt}",) if salt and not self.faults.salt_ignored else ())
        extra += (f"lora:{lora_name}",) if lora_name else ()
        keys = block_keys(token_ids, BLOCK, extra, images)
        with self.lock:
            stored, parent = [], None
            for i, key in enumerate(keys):
                if key not in self.published and not (self.faults.orphans and i == 0):
                    named = None if self.faults.parent_in_batch_only and not stored else parent
                    block = () if self.faults.bare_blocks else tuple(
                        0 if self.faults.image_ids_hidden and t == PLACEHOLDER else t
                        for t in token_ids[i * BLOCK:(i + 1) * BLOCK])
                    stored.append(BlockStored(key, named, block, 0 if self.faults.bare_blocks else BLOCK,
                                              block_extra_keys(i, BLOCK, extra, images)))
                parent = key
            if self.faults.partial_blocks and len(token_ids) % BLOCK:
                stored.append(BlockStored(bytes(16), parent, tuple(token_ids[len(keys) * BLOCK:]), BLOCK, extra))
            for key in keys:  # this prompt's cached blocks are the most recent: never evicted for it
                if key in self.published:
                    self.published.move_to_end(key)
            removed = self.evict(len(self.published) + len(stored) - TOTAL_BLOCKS)
            new = {event.block_hash: event for event in stored}
            for key in reversed([*keys, *new.keys() - set(keys)]):  # a chain's tail is evicted before its root
                if (event := new.get(key) or self.published.get(key)) is not None:  # None: the orphans fault
                    self.published[key] = event
                    self.published.move_to_end(key)
            if self.faults.announce_once:
                stored = [event for event in stored if event.block_hash not in self.ever_published]
            self.ever_published.update(new)
            if removed or stored:
                if self.faults.gap:
                    self.hub._last_sequence_number += 1
                late = self.faults.lagging or self.faults.staggered
                for i, part in enumerate(_batches(removed, stored, 16 if late else len(stored) or 1)):
                    self.hub.publish(part)
                    if i:
                        self.later_batches.add(self.hub.last_sequence_number)
                if self.faults.repeat_numbers:
                    self.hub._last_sequence_number -= 1

    def snapshot(self) -> list[BlockStored]:
        """The cached blocks, every parent before its children."""
        ordered: dict[bytes, BlockStored] = {}

        def visit(event: BlockStored) -> None:
            if event.block_hash not in ordered:
                if event.parent_hash in self.published:
                    visit(self.published[event.parent_hash])
                ordered[event.block_hash] = event

        for event in list(self.published.values()):
            visit(event)
        if self.faults.leafless_snapshot:
            parents = {event.parent_hash for event in ordered.values()}
            return [event for event in ordered.values() if event.block_hash in parents]
        return list(ordered.values())

    def evict(self, count: int) -> list[BlockRemoved]:
        """Forget the ``count`` least recently used blocks; their BlockRemoved events."""
        gone = [self.published.popitem(last=False)[0] for _ in range(max(0, count))]
        return [] if self.faults.silent_eviction else [BlockRemoved(key) for key in gone]

    def oldest(self) -> int:
        return self.hub._retained[0].sequence_number if self.hub._retained else self.hub.last_sequence_number + 1


class KvInference(Inference):
    def __init__(self, engine: ToyEngine, cache: ToyKvCache) -> None:
        super().__init__(engine)
        self.cache = cache

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        faults = self.engine.faults
        tokens, images = [ord(c) % 128 for c in request.prompt] or list(request.token_ids.ids), []
        if faults.images:
            tokens, images = requested(request, tokens)
        self.cache.store_prompt(tokens, request.kv.cache_salt, "" if faults.lora_not_in_hash else request.lora_name,
                                [] if faults.media_not_in_hash else images)
        yield from super().Generate(request, context)


class KvControl(Control):
    def __init__(self, engine: ToyEngine, cache: ToyKvCache) -> None:
        super().__init__(engine)
        self.cache = cache
        # The advertised event source: a TCP listener (E6 dials it), or under the fault a port
        # that is bound but not listening (connection refused). Kept bound: a port closed again
        # could be taken by another test's server meanwhile, and then E6 connected (CI saw it).
        if cache.faults.unconnectable_source:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind(("127.0.0.1", 0))
        else:
            listener = socket.create_server(("127.0.0.1", 0))
        self.source_port = listener.getsockname()[1]
        weakref.finalize(self, listener.close)

    def _check_ranks(self, ranks: list[int], context: grpc.ServicerContext) -> None:
        if not self.cache.faults.accept_bad_ranks and (set(ranks) - {0} or len(set(ranks)) != len(ranks)):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad ranks {ranks}")

    def GetKvEventSources(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        self._check_ranks(list(request.data_parallel_ranks), context)
        faults = self.cache.faults
        if faults.no_sources or (faults.no_source_for_a_rank and request.data_parallel_ranks):
            return oe.GetKvEventSourcesResponse()
        host = "0.0.0.0" if faults.wildcard_host else "127.0.0.1"
        return oe.GetKvEventSourcesResponse(sources=[oe.KvEventSource(
            transport="zmq", endpoint_addr=oe.KvEndpoint(host=host, port=self.source_port, protocol="tcp"),
            data_parallel_rank=0)])

    def SubscribeKvEvents(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        self._check_ranks(list(request.data_parallel_ranks), context)
        cache, faults, ready = self.cache, self.cache.faults, threading.Event()
        start = request.start_sequence_number
        with cache.lock:
            expired = 0 < start < cache.oldest()
            if faults.silent_expired and expired:
                start = cache.oldest()
            elif faults.replay_skips_first and start and not expired:
                start += 1
            snapshot = [] if faults.empty_snapshot else cache.snapshot()
            sub = cache.hub.subscribe(ready.set, snapshot if request.include_snapshot else None, start)
        try:
            if sub.failure and (faults.status_on_failure or (faults.status_on_expired and expired)):
                context.abort(grpc.StatusCode.OUT_OF_RANGE, sub.failure)
            while context.is_active():
                ready.wait(0.05)
                ready.clear()
                batches, failure = sub.take()
                for batch in batches:
                    if (faults.lagging or faults.staggered) and not batch.snapshot:  # RULES set no latency bound
                        later = faults.staggered and batch.sequence_number in cache.later_batches
                        lag = faults.lag_seconds * (2 if later else 1)
                        time.sleep(max(0.0, batch.timestamp_unix_nanos / 1e9 + lag - time.time()))
                    yield batch_response(batch, oe.STORAGE_MEDIUM_UNSPECIFIED)
                if failure:
                    yield oe.SubscribeKvEventsResponse(error=oe.EngineError(
                        code=oe.ERROR_CODE_INVALID_ARGUMENT, message=failure))
                    return
        finally:
            sub.close()


def serve_kv(kv: KvFaults, faults: Faults | None = None) -> tuple[grpc.Server, str, ToyEngine]:
    """The toy server (``faults``) with KV events (``kv``); returns (server, address, engine)."""
    engine, cache = ToyEngine(faults or Faults()), ToyKvCache(kv)
    server, address = start(engine, KvInference(engine, cache), KvControl(engine, cache))
    return server, address, engine
