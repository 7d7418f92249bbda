"""The block pool: the state of every KV block, the prefix cache, the KV event queue.

Invariant (checked by ``check_integrity``): every block is in exactly one state:

- free:   ref_count 0, no hash, not sealed, in ``free_block_ids``;
- cached: ref_count 0, has a hash, in ``evictable`` (LRU order, oldest first);
- used:   ref_count > 0 (it may also have a hash: a cached prefix in use).

so ``num_free + num_cached + num_used == num_blocks``. ``ref_count`` is the number
of owner references (sequence block tables, named holdings in the manager).
Allocation takes free blocks first, then evicts cached blocks oldest-first.

Prefix cache: a block with a hash is *published*: ``hash_to_block`` maps each
published hash to its one block, and only sealed blocks are published. A block is
*sealed* once it is full and has been offered to the cache (``cache_block``),
whether it was published or not; it is never offered again until it is reused.
A published block's parent hash was published when it was (parent before child).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from refengine.types import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, LoraAdapterSpec


@dataclass
class KvBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set while published in the prefix cache
    sealed: bool = False  # full and offered to the prefix cache: cache_full_blocks skips it


def _require(condition: bool, message: str) -> None:
    """An invariant check that survives ``python -O`` (unlike ``assert``)."""
    if not condition:
        raise AssertionError(message)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, *, record_events: bool = False) -> None:
        """``record_events``: keep a KV event queue for ``take_events``. Off by default, so an
        engine without a subscriber neither builds event objects nor grows a queue."""
        if num_blocks <= 0:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KvBlock(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks with no user, LRU first
        self.hash_to_block: dict[bytes, int] = {}
        self._events: list[KvEvent] | None = [] if record_events else None
        # What a subscriber's view holds (hash -> its stored event), in publication order, so a
        # new subscriber can start from a snapshot; kept only while recording events.
        self._published: dict[bytes, BlockStored] = {}

    # -- queries -------------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Blocks an allocation can get right now (free + evictable)."""
        return len(self.free_block_ids) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    @property
    def num_cached(self) -> int:
        return len(self.evictable)

    def lookup(self, block_hash: bytes) -> int | None:
        return self.hash_to_block.get(block_hash) if self.enable_caching else None

    def take_events(self) -> list[KvEvent]:
        """The KV events since the last call, oldest first (empty when not recording)."""
        if self._events is None:
            return []
        events, self._events = self._events, []
        return events

    # -- ownership -----------------------------------------------------------
    def allocate(self, num: int) -> list[int]:
        """Take ``num`` blocks (ref_count 1 each). Caller checks ``num_available`` first."""
        if num > self.num_available:
            raise RuntimeError(f"asked for {num} KV blocks, {self.num_available} available")
        allocated = []
        for _ in range(num):
            if self.free_block_ids:
                block = self.blocks[self.free_block_ids.popleft()]
            else:
                block_id, _ = self.evictable.popitem(last=False)
                block = self.blocks[block_id]
                self._unpublish(block)  # the BlockRemoved is queued before the block is reused
                block.sealed = False
            block.ref_count = 1
            allocated.append(block.block_id)
        # Ascending ids: a sequence's blocks are then as often as possible one contiguous range
        # per KV tensor, which a KV transfer moves as one descriptor instead of one per block.
        allocated.sort()
        return allocated

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block (a prefix-cache hit or a fork)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.evictable[block_id]  # KeyError here means touching a free block: a bug
            block.ref_count += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block. Pass blocks tail-first so that, among a
        sequence's cached blocks, the tail is evicted before the shared head."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            _require(block.ref_count > 0, f"double free of KV block {block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._park(block)

    def _park(self, block: KvBlock) -> None:
        """A block that lost its last reference: keep it evictable if published, else free it."""
        if block.block_hash is not None:
            self.evictable[block.block_id] = None
        else:
            block.sealed = False
            self.free_block_ids.append(block.block_id)

    # -- prefix cache --------------------------------------------------------
    def cache_block(
        self,
        block_id: int,
        block_hash: bytes,
        parent_hash: bytes | None,
        token_ids: Sequence[int],
        extra_keys: tuple[str, ...],
        lora: LoraAdapterSpec | None = None,
        parent_block_id: int | None = None,
    ) -> bool:
        """Seal a full, referenced block and publish it under its chain hash if allowed.
        Returns whether it was published (and a ``BlockStored`` queued). ``parent_block_id``:
        the block before it in its sequence's table (None for the first).

        Not published, though sealed (so never offered again while in use), when:
        caching is off; the block is already sealed; another block already published
        ``block_hash`` (computed concurrently: the first one wins); or ``parent_hash``
        is not published by ``parent_block_id`` itself: evicted or reset since, because a
        subscriber must never see a child whose parent it does not know, or published by
        another block (the sequence's own parent is a concurrent duplicate), because that
        other block, referenced by no sequence here, could be evicted while this child stays
        published: an orphan no lookup reaches, announced as cached.
        """
        block = self.blocks[block_id]
        _require(block.ref_count > 0, f"publishing KV block {block_id}, which nobody references")
        if block.sealed:
            return False
        block.sealed = True
        if not self.enable_caching or block_hash in self.hash_to_block:
            return False
        if parent_hash is not None and self.hash_to_block.get(parent_hash, -1) != parent_block_id:
            return False
        block.block_hash = block_hash
        self.hash_to_block[block_hash] = block_id
        if self._events is not None:
            event = BlockStored(block_hash, parent_hash, tuple(token_ids), len(token_ids), extra_keys, lora)
            self._events.append(event)
            self._published[block_hash] = event
        return True

    def snapshot(self) -> list[BlockStored]:
        """A ``BlockStored`` for every published block, parents before children (publication
        order, with a child whose parent was re-published later moved after it): replayed
        into an empty view it gives the view the event stream has built so far."""
        published = self._published
        out: list[BlockStored] = []
        emitted: set[bytes] = set()
        waiting: dict[bytes, list[BlockStored]] = {}
        for event in published.values():
            parent = event.parent_hash
            if parent is not None and parent in published and parent not in emitted:
                waiting.setdefault(parent, []).append(event)
                continue
            ready = [event]
            while ready:
                done = ready.pop()
                out.append(done)
                emitted.add(done.block_hash)
                ready.extend(waiting.pop(done.block_hash, ()))
        return out

    def reset_prefix_cache(self) -> int:
        """Forget every published hash; returns how many cached (unreferenced) blocks were
        freed. Queues exactly one ``AllBlocksCleared`` (when caching is on), never
        per-block removals: the subscriber drops its whole view.

        Blocks still in use lose their hashes too, so nothing stays published that the
        subscriber does not know of. They stay sealed and are not re-announced, and since
        a child is only published after its parent, nothing chained onto them is published
        either: the sequences running at a reset simply stop feeding the cache. Their
        blocks go back to the free list when released.
        """
        if not self.enable_caching:
            return 0
        dropped = len(self.evictable)
        for block_id in self.hash_to_block.values():
            block = self.blocks[block_id]
            block.block_hash = None
            if block.ref_count == 0:
                block.sealed = False
        self.free_block_ids.extend(self.evictable)
        self.evictable.clear()
        self.hash_to_block.clear()
        self._published.clear()
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return dropped

    def _unpublish(self, block: KvBlock) -> None:
        assert block.block_hash is not None, "only published blocks are evictable"
        del self.hash_to_block[block.block_hash]
        if self._events is not None:
            self._events.append(BlockRemoved(block.block_hash))
            self._published.pop(block.block_hash, None)
        block.block_hash = None

    # -- invariant -----------------------------------------------------------
    def check_integrity(self) -> None:
        """The pool-only invariant (module docstring); ``KvCacheManager.check_integrity``
        adds the per-owner reference counts."""
        free = set(self.free_block_ids)
        cached = set(self.evictable)
        used = {b.block_id for b in self.blocks if b.ref_count > 0}
        _require(len(free) == len(self.free_block_ids), "a KV block is on the free list twice")
        _require(not (free & cached or free & used or cached & used), "a KV block is in two states")
        _require(len(free) + len(cached) + len(used) == self.num_blocks, "a KV block is lost")
        for block in self.blocks:
            _require(block.ref_count >= 0, f"KV block {block.block_id} has a negative ref_count")
            if block.block_id in free:
                _require(block.block_hash is None and not block.sealed, f"free KV block {block.block_id} is sealed")
            if block.block_id in cached:
                _require(block.block_hash is not None, f"cached KV block {block.block_id} has no hash")
            if block.block_hash is not None:
                _require(block.sealed, f"KV block {block.block_id} is published but not sealed")
                _require(self.hash_to_block.get(block.block_hash) == block.block_id, "a hash maps to another block")
        num_published = sum(b.block_hash is not None for b in self.blocks)
        _require(num_published == len(self.hash_to_block), "hash_to_block names an unpublished block")
        _require(self.enable_caching or not self.hash_to_block, "a block is published with caching off")
