"""Per-sequence KV bookkeeping on top of the block pool: prefix-cache lookup,
slot allocation with copy-on-write, publishing full blocks, freeing.

The manager works on block counts and ids only; the KV tensors live in the model
runner, which executes the block copies the manager asks for.
"""

from __future__ import annotations

from typing import Protocol

from refengine.kv.block_pool import BlockPool
from refengine.kv.prefix_hash import hash_full_blocks


class KvSequence(Protocol):
    """What the manager needs to know about a sequence."""

    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    block_hashes: list[bytes]
    extra_keys: tuple[str, ...]


class KvCacheManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: KvSequence) -> list[int]:
        """Block ids of the longest cached prefix of ``seq``'s tokens.

        At least the last token is always left to compute: its logits are needed to
        sample the next token. The blocks are not yet referenced; ``allocate``
        takes them.
        """
        if not self.pool.enable_caching:
            return []
        max_cached_blocks = (len(seq.token_ids) - 1) // self.block_size
        hashes = hash_full_blocks(seq.token_ids, self.block_size, seq.extra_keys, seq.block_hashes)
        hit_block_ids = []
        for block_hash in hashes[:max_cached_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hit_block_ids.append(block_id)
        return hit_block_ids

    def allocate(
        self, seq: KvSequence, num_new_tokens: int, cached_block_ids: list[int] | None = None
    ) -> list[tuple[int, int]] | None:
        """Make room for ``num_new_tokens`` after the computed ones.

        ``cached_block_ids`` (from ``find_cached_prefix``, only for a sequence with no
        blocks yet) become the head of the block table and count as computed.
        Returns the (src, dst) block copies to run before the step (copy-on-write
        of a shared partial block), or ``None`` when the pool is too small right
        now — in which case nothing changed.
        """
        cached_block_ids = cached_block_ids or []
        num_cached_tokens = len(cached_block_ids) * self.block_size
        start = seq.num_computed_tokens + num_cached_tokens
        num_needed = self.num_blocks_for(start + num_new_tokens) - len(seq.block_table) - len(cached_block_ids)
        copy_src = self._shared_partial_block(seq, start)
        num_to_allocate = max(num_needed, 0) + (copy_src is not None)
        # Blocks about to be touched that are evictable stop counting as available.
        num_evictable_hits = sum(1 for b in cached_block_ids if self.pool.blocks[b].ref_count == 0)
        if num_to_allocate > self.pool.num_available - num_evictable_hits:
            return None
        self.pool.touch(cached_block_ids)
        seq.block_table.extend(cached_block_ids)
        seq.num_computed_tokens += num_cached_tokens
        copies = []
        if copy_src is not None:
            (copy_dst,) = self.pool.allocate(1)
            slot = start // self.block_size
            seq.block_table[slot] = copy_dst
            self.pool.free([copy_src])
            copies.append((copy_src, copy_dst))
        if num_needed > 0:
            seq.block_table.extend(self.pool.allocate(num_needed))
        return copies

    def _shared_partial_block(self, seq: KvSequence, start: int) -> int | None:
        """The block that the next write lands in, if it is partial and shared."""
        if start % self.block_size == 0 or start // self.block_size >= len(seq.block_table):
            return None
        block_id = seq.block_table[start // self.block_size]
        return block_id if self.pool.blocks[block_id].ref_count > 1 else None

    def cache_full_blocks(self, seq: KvSequence) -> None:
        """Publish every full block whose tokens are all computed."""
        if not self.pool.enable_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        hashes = hash_full_blocks(
            seq.token_ids[: num_full * self.block_size], self.block_size, seq.extra_keys, seq.block_hashes
        )
        # Blocks are published in order, so walking back from the newest full block
        # can stop at the first one that already carries a hash.
        for i in reversed(range(num_full)):
            if self.pool.blocks[seq.block_table[i]].block_hash is not None:
                break
            self.pool.cache_block(seq.block_table[i], hashes[i])

    def fork(self, parent: KvSequence, child: KvSequence) -> None:
        """Let ``child`` share every block of ``parent`` (copy-on-write later)."""
        self.pool.touch(parent.block_table)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: KvSequence) -> None:
        self.pool.free(reversed(seq.block_table))
        seq.block_table = []
        seq.num_computed_tokens = 0
