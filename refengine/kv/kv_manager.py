"""Per-sequence KV bookkeeping on top of the block pool: prefix-cache lookup,
slot allocation with copy-on-write, publishing full blocks, named owners, freeing.

Every block reference is held by an owner: a sequence (its ``block_table``) or a
named holding (``transfer``: e.g. a KV session pinning a finished prefill's blocks
under a lease). A block's ``ref_count`` is its number of owner references, and it
is freed (or parked as cached) when the last owner lets go. ``check_integrity``
checks exactly that.

The manager works on block counts and ids only; the KV tensors live in the model
runner, which executes the block copies the manager asks for.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Protocol

from refengine.kv.block_pool import BlockPool, KvBlock
from refengine.kv.prefix_hash import MediaSpan, block_extra_keys, hash_full_blocks
from refengine.types import LoraAdapterSpec


class KvSequence(Protocol):
    """What the manager needs to know about a sequence."""

    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    block_hashes: list[bytes]
    extra_keys: tuple[str, ...]
    lora: LoraAdapterSpec | None  # the adapter its KV is computed under (for KV events)
    media_spans: tuple[MediaSpan, ...]  # its media items' positions and identities


class KvCacheManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._holdings: dict[str, tuple[int, ...]] = {}  # owner name -> block ids it references
        self.num_withheld_blocks = 0  # held for good (``withhold``): the pool never gives them out again

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
        hashes = hash_full_blocks(seq.token_ids, self.block_size, seq.extra_keys, seq.block_hashes,
                                  media_spans=seq.media_spans)
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
        """Publish the blocks that became full (all tokens computed) since the last call,
        parent before child. O(new full blocks): sealed blocks form a prefix of every
        block table (blocks are sealed in order, prefix hits are sealed, copy-on-write
        only replaces a partial block), so the walk back stops at the first sealed one.
        """
        if not self.pool.enable_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        first_new = num_full
        while first_new > 0 and not self._block_at(seq, first_new - 1).sealed:
            first_new -= 1
        if first_new == num_full:
            return
        hashes = hash_full_blocks(seq.token_ids, self.block_size, seq.extra_keys, seq.block_hashes, num_full,
                                  seq.media_spans)
        for i in range(first_new, num_full):
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            parent = hashes[i - 1] if i else None
            keys = block_extra_keys(i, self.block_size, seq.extra_keys, seq.media_spans)
            self.pool.cache_block(seq.block_table[i], hashes[i], parent, tokens, keys, seq.lora,
                                  seq.block_table[i - 1] if i else None)

    def _block_at(self, seq: KvSequence, slot: int) -> KvBlock:
        return self.pool.blocks[seq.block_table[slot]]

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

    # -- named owners ----------------------------------------------------------
    def transfer(self, seq: KvSequence, owner: str) -> tuple[int, ...]:
        """Move ``seq``'s block references to the named ``owner``; no ref_count changes.

        ``seq`` is left like a freed sequence (empty table, nothing computed). Returns
        the block ids ``owner`` now holds, in table order. The full blocks stay published,
        so they remain prefix-cache hits while held and, once released, cached. Publishing
        is not done here: ``cache_full_blocks`` has done it after the sequence's last step.
        """
        if owner in self._holdings:
            raise ValueError(f"KV owner {owner!r} already holds {len(self._holdings[owner])} blocks; release it first")
        held = tuple(seq.block_table)
        self._holdings[owner] = held
        seq.block_table = []
        seq.num_computed_tokens = 0
        return held

    def withhold(self, seq: KvSequence, owner: str, first_block_index: int) -> tuple[int, ...]:
        """Hold ``seq``'s blocks from ``first_block_index`` on under ``owner`` until restart and
        free those before it: a write from outside the engine (a transfer that could not be
        stopped) may still land in the tail, so it is never reused; the head (prefix-cache hits)
        is not written by it. The pool's usable size shrinks by the tail for good."""
        self.transfer(seq, owner)
        return self.withhold_held(owner, first_block_index)

    def withhold_held(self, owner: str, first_block_index: int) -> tuple[int, ...]:
        """``withhold`` for blocks ``owner`` already holds (a sequence ``transfer``-ed to it before
        the write that may still land was known): frees the head, keeps the tail, for good."""
        held = self.held_block_ids(owner)
        head, tail = held[:first_block_index], held[first_block_index:]
        self.pool.free(reversed(head))
        self._holdings[owner] = tail
        self.num_withheld_blocks += len(tail)
        return tail

    @property
    def num_usable_blocks(self) -> int:
        """The most blocks one sequence can ever hold: the pool less the withheld."""
        return self.pool.num_blocks - self.num_withheld_blocks

    def release(self, owner: str) -> int:
        """Drop every reference ``owner`` holds (tail-first, like ``free``, so that shared
        heads stay cached longest). Returns how many references were dropped."""
        held = self._holdings.pop(owner, None)
        if held is None:
            raise KeyError(f"no KV owner {owner!r}: never transferred to, or already released")
        self.pool.free(reversed(held))
        return len(held)

    def held_block_ids(self, owner: str) -> tuple[int, ...]:
        held = self._holdings.get(owner)
        if held is None:
            raise KeyError(f"no KV owner {owner!r}: never transferred to, or already released")
        return held

    @property
    def owners(self) -> tuple[str, ...]:
        return tuple(self._holdings)

    # -- invariant -------------------------------------------------------------
    def check_integrity(self, sequence_tables: Iterable[Sequence[int]] = ()) -> None:
        """The pool's invariant, plus: every block's ref_count equals its references across
        ``sequence_tables`` (pass every live sequence's block table) and every named
        owner's holding. A mismatch names the block: more ref_count than references is a
        leak (a table dropped without ``free``), fewer is a double free or a table that
        shares a block without ``touch``."""
        self.pool.check_integrity()
        refs: Counter[int] = Counter()
        for table in sequence_tables:
            refs.update(table)
        for held in self._holdings.values():
            refs.update(held)
        for block in self.pool.blocks:
            if block.ref_count != refs[block.block_id]:
                raise AssertionError(self._describe_mismatch(block, refs[block.block_id]))

    def _describe_mismatch(self, block: KvBlock, num_refs: int) -> str:
        holders = [name for name, held in self._holdings.items() if block.block_id in held]
        kind = "leaked" if block.ref_count > num_refs else "over-released"
        return (
            f"KV block {block.block_id} {kind}: ref_count {block.ref_count}, but {num_refs} references "
            f"(sequence tables + owners {holders})"
        )
