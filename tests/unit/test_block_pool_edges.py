"""Block pool edge cases: pool size, allocation order, cache_block's contract, eviction and
re-publication, the replayable snapshot, reset_prefix_cache, and check_integrity's checks.

A mutation run over refengine/kv/block_pool.py (comparisons flipped, constants moved, statements
deleted) found these behaviours untested; each test pins one rule stated by the module.
"""

from __future__ import annotations

import random

import pytest

from refengine.kv.block_pool import BlockPool
from refengine.kv.kv_manager import KvCacheManager
from tests.unit.kv_helpers import Seq, compute, replay


def test_pool_rejects_zero_blocks_accepts_one() -> None:
    """A pool needs at least one block: zero or a negative size is a configuration error, and
    the smallest valid pool has exactly one block available."""
    with pytest.raises(ValueError):
        BlockPool(0)
    with pytest.raises(ValueError):
        BlockPool(-1)
    assert BlockPool(1).num_available == 1


def test_allocate_returns_ascending_ids() -> None:
    """Allocated ids come back in ascending order whatever the free list's order, so a KV
    transfer moves one contiguous range instead of one descriptor per block."""
    pool = BlockPool(8)
    ids = pool.allocate(8)
    pool.free([ids[5], ids[1], ids[6], ids[0]])  # free list order: 5, 1, 6, 0
    assert pool.allocate(4) == sorted([ids[5], ids[1], ids[6], ids[0]])


def test_evicted_block_is_unsealed_and_published_again_when_reused() -> None:
    """An evicted block is unsealed when reused; a block that kept its seal would never be
    offered to the prefix cache again, so every sequence that lands on a recycled block would
    silently stop feeding the cache."""
    pool = BlockPool(2)
    kv = KvCacheManager(pool, block_size=2)
    a = Seq([1, 2, 3, 4])
    assert compute(kv, a, 4)
    kv.free(a)
    assert pool.num_cached == 2
    b = Seq([9, 9, 8, 8])  # different tokens: both cached blocks are evicted and reused
    assert compute(kv, b, 4)
    assert pool.num_cached == 0
    assert len(pool.hash_to_block) == 2, "the recycled blocks must be published under b's hashes"
    kv.free(b)
    c = Seq([9, 9, 8, 8, 7])
    assert len(kv.find_cached_prefix(c)) == 2
    pool.check_integrity()


def test_cache_block_on_unreferenced_block_is_an_error() -> None:
    """Only a referenced block may be published: publishing a free block would put it in
    ``hash_to_block``, and a later prefix hit would read garbage KV."""
    pool = BlockPool(2)
    with pytest.raises(AssertionError):
        pool.cache_block(0, b"h" * 32, None, [1, 2], ())
    (block,) = pool.allocate(1)
    assert pool.cache_block(block, b"h" * 32, None, [1, 2], ()) is True


def test_cache_block_return_values() -> None:
    """``cache_block`` returns whether the block was published: False for an already sealed
    block, a duplicate hash, a parent that is only a copy, and with caching off."""
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    assert pool.cache_block(a, b"A" * 32, None, [1], ()) is True
    assert pool.cache_block(a, b"A" * 32, None, [1], ()) is False  # already sealed
    assert pool.cache_block(b, b"A" * 32, None, [1], ()) is False  # duplicate hash
    assert pool.cache_block(c, b"C" * 32, b"A" * 32, [2], (), parent_block_id=b) is False  # parent is a copy
    off = BlockPool(2, enable_caching=False)
    (d,) = off.allocate(1)
    assert off.cache_block(d, b"D" * 32, None, [1], ()) is False


def _evict_parent_keep_child() -> tuple[BlockPool, KvCacheManager, bytes, bytes]:
    """A published child whose parent is evicted, then the parent recomputed and re-published:
    the snapshot must move the child after its re-published parent."""
    pool = BlockPool(4, record_events=True)
    kv = KvCacheManager(pool, block_size=2)
    a = Seq([1, 2, 3, 4])
    assert compute(kv, a, 4)
    parent_block, child_block = a.block_table
    parent_hash, child_hash = a.block_hashes
    kv.withhold(a, "quarantine", 1)  # frees the head (parent), holds the child
    taken = pool.allocate(3)  # 2 free + the parent, evicted
    assert parent_hash not in pool.hash_to_block and child_hash in pool.hash_to_block
    # A hit must be a contiguous prefix: the child's hash is still published, but without its
    # parent it is no hit (a lookup that skips the missing block would return it).
    assert kv.find_cached_prefix(Seq([1, 2, 3, 4, 5])) == []
    pool.free(taken)
    b = Seq([1, 2, 9])
    assert compute(kv, b, 3)  # recomputes the parent block: published again (after the child)
    assert parent_hash in pool.hash_to_block
    return pool, kv, parent_hash, child_hash


def test_snapshot_moves_child_after_republished_parent() -> None:
    """The snapshot lists every published block after its parent, even when the parent was
    re-published after the child; a subscriber replaying it would otherwise reject the child."""
    pool, _, parent_hash, child_hash = _evict_parent_keep_child()
    snap = pool.snapshot()
    assert [e.block_hash for e in snap] == [parent_hash, child_hash]
    view: dict[bytes, bytes | None] = {}
    replay(view, snap)
    assert set(view) == set(pool.hash_to_block)


@pytest.mark.parametrize("seed", range(4))
def test_snapshot_replays_to_the_event_view(seed: int) -> None:
    """After any history, replaying ``snapshot()`` into an empty view (which rejects children
    before parents) gives the view the event stream built, and that is the pool's published set.
    The engine-level check compares them as dicts, so it never tests the snapshot's order, and
    the older unit test evicts everything first."""
    rng = random.Random(seed)
    pool = BlockPool(16, record_events=True)
    kv = KvCacheManager(pool, block_size=2)
    view: dict[bytes, bytes | None] = {}
    live: list[Seq] = []
    owners = 0
    for step in range(400):
        op = rng.random()
        if op < 0.45:
            s = Seq([rng.randrange(3) for _ in range(rng.randrange(1, 9))])
            hits = kv.find_cached_prefix(s)
            if kv.allocate(s, len(s.token_ids) - 2 * len(hits), hits) is not None:
                s.num_computed_tokens = len(s.token_ids)
                kv.cache_full_blocks(s)
                live.append(s)
        elif op < 0.8 and live:
            kv.free(live.pop(rng.randrange(len(live))))
        elif op < 0.9 and live:
            s = live.pop(rng.randrange(len(live)))
            kv.transfer(s, f"o{owners}")  # a named owner (a KV session) holds it, then lets go
            kv.release(f"o{owners}")
            owners += 1
        elif op < 0.93:
            pool.reset_prefix_cache()
        elif pool.num_available:
            pool.free(pool.allocate(rng.randrange(1, pool.num_available + 1)))  # evictions
        replay(view, pool.take_events())
        assert set(view) == set(pool.hash_to_block)
        fresh: dict[bytes, bytes | None] = {}
        replay(fresh, pool.snapshot())
        assert fresh == view, f"step {step}"
        kv.check_integrity(s.block_table for s in live)


def test_reset_prefix_cache_returns_number_of_cached_blocks_freed() -> None:
    """``reset_prefix_cache`` returns how many cached blocks it freed: 0 (and no event) with
    caching off, otherwise every cached block, which all go back to the free list."""
    off = BlockPool(2, enable_caching=False, record_events=True)
    assert off.reset_prefix_cache() == 0
    assert off.take_events() == []
    pool = BlockPool(4)
    kv = KvCacheManager(pool, block_size=2)
    a = Seq([1, 2, 3, 4])
    compute(kv, a, 4)
    kv.free(a)
    assert pool.reset_prefix_cache() == 2
    assert pool.num_cached == 0 and len(pool.free_block_ids) == 4
    pool.check_integrity()


def _published_pool() -> tuple[BlockPool, int, bytes]:
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    assert pool.cache_block(block, b"P" * 32, None, [1, 2], ())
    return pool, block, b"P" * 32


def _corrupt(kind: str) -> BlockPool:
    """A pool with exactly one corruption of the given kind."""
    if kind == "free list twice":
        pool = BlockPool(4)
        pool.free_block_ids.append(pool.free_block_ids[0])
    elif kind == "two states":
        pool, block, _ = _published_pool()
        pool.free([block])  # cached
        pool.free_block_ids.append(block)  # and free
    elif kind == "lost":
        pool = BlockPool(4)
        pool.free_block_ids.pop()
    elif kind == "negative ref_count":
        pool = BlockPool(4)
        pool.blocks[pool.free_block_ids[0]].ref_count = -1
    elif kind == "is sealed":  # a free block that is sealed
        pool = BlockPool(4)
        pool.blocks[pool.free_block_ids[0]].sealed = True
    elif kind == "has no hash":  # a cached block without a hash
        pool = BlockPool(4)
        pool.evictable[pool.free_block_ids.pop()] = None
    elif kind == "published but not sealed":
        pool, block, _ = _published_pool()
        pool.blocks[block].sealed = False
    elif kind == "maps to another block":
        pool, block, h = _published_pool()
        (other,) = pool.allocate(1)
        pool.hash_to_block[h] = other
    elif kind == "names an unpublished block":
        pool, block, _ = _published_pool()
        (other,) = pool.allocate(1)
        pool.hash_to_block[b"Q" * 32] = other
    else:
        assert kind == "caching off"
        pool = BlockPool(4, enable_caching=False)
        (block,) = pool.allocate(1)
        pool.blocks[block].block_hash = b"P" * 32
        pool.blocks[block].sealed = True
        pool.hash_to_block[b"P" * 32] = block
    return pool


@pytest.mark.parametrize("kind", ["free list twice", "two states", "lost", "negative ref_count", "is sealed",
                                  "has no hash", "published but not sealed", "maps to another block",
                                  "names an unpublished block", "caching off"])
def test_check_integrity_detects_each_corruption(kind: str) -> None:
    """Each corruption is reported by its own check (matched by message). ``check_integrity`` is
    the engine's ``debug_kv_integrity`` safety net; if no test ever makes it fail, losing any
    one of its ten checks goes unnoticed."""
    pool = _corrupt(kind)
    message = {"caching off": "published with caching off"}.get(kind, kind)
    with pytest.raises(AssertionError, match=message):
        pool.check_integrity()
