"""The block pool: who owns every KV block.

Invariant (checked by ``check_integrity``): every block is in exactly one state:

- free:   ref_count 0, no hash, in ``free_block_ids``;
- cached: ref_count 0, has a hash, in ``evictable`` (LRU order, oldest first);
- used:   ref_count > 0 (it may also have a hash: a cached prefix in use).

so ``num_free + num_cached + num_used == num_blocks``. Allocation takes free
blocks first, then evicts cached blocks oldest-first.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass
class KvBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


BlockEventHook = Callable[[str, bytes], None]  # ("stored" | "removed", block_hash)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KvBlock(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks with no user, LRU first
        self.hash_to_block: dict[bytes, int] = {}
        self.event_hooks: list[BlockEventHook] = []

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
                self._drop_hash(block)
            block.ref_count = 1
            allocated.append(block.block_id)
        return allocated

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a user to each block (a prefix-cache hit or a fork)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.evictable[block_id]
            block.ref_count += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one user from each block. Pass blocks tail-first so that, among a
        sequence's cached blocks, the tail is evicted before the shared head."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of KV block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self.evictable[block_id] = None
                else:
                    self.free_block_ids.append(block_id)

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Publish a full block under its chain hash. A second block with the same
        hash (computed concurrently) is not published: the first one wins."""
        if not self.enable_caching or block_hash in self.hash_to_block:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.hash_to_block[block_hash] = block_id
        for hook in self.event_hooks:
            hook("stored", block_hash)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block with no user; returns how many were dropped."""
        dropped = 0
        while self.evictable:
            block_id, _ = self.evictable.popitem(last=False)
            block = self.blocks[block_id]
            self._drop_hash(block)
            self.free_block_ids.append(block_id)
            dropped += 1
        return dropped

    def _drop_hash(self, block: KvBlock) -> None:
        if block.block_hash is None:
            return
        del self.hash_to_block[block.block_hash]
        for hook in self.event_hooks:
            hook("removed", block.block_hash)
        block.block_hash = None

    def check_integrity(self) -> None:
        free = set(self.free_block_ids)
        cached = set(self.evictable)
        used = {b.block_id for b in self.blocks if b.ref_count > 0}
        assert len(free) == len(self.free_block_ids), "a block is on the free list twice"
        assert not (free & cached) and not (free & used) and not (cached & used)
        assert len(free) + len(cached) + len(used) == self.num_blocks, "a KV block is lost"
        for block_id in free:
            assert self.blocks[block_id].block_hash is None
        for block_id in cached:
            assert self.blocks[block_id].block_hash is not None
        for block_hash, block_id in self.hash_to_block.items():
            assert self.blocks[block_id].block_hash == block_hash
