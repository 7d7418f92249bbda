"""Block pool and KV manager: ownership, prefix-cache hits, copy-on-write, LRU eviction."""

from __future__ import annotations

import random

import pytest

from refengine.kv.block_pool import BlockPool
from refengine.kv.kv_manager import KvCacheManager
from refengine.kv.prefix_hash import hash_block
from refengine.types import BlockRemoved, BlockStored
from tests.unit.kv_helpers import Seq


def make_seq(tokens: list[int], extra: tuple[str, ...] = ()) -> Seq:
    return Seq(list(tokens), extra)


def test_allocate_free_returns_to_idle() -> None:
    pool = BlockPool(8)
    ids = pool.allocate(5)
    assert len(set(ids)) == 5 and pool.num_available == 3
    pool.check_integrity()
    pool.free(ids)
    assert pool.num_available == 8 and pool.num_used == 0
    pool.check_integrity()


def test_over_allocation_raises_and_double_free_asserts() -> None:
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.allocate(3)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(AssertionError):
        pool.free([block])


def test_hash_chain_depends_on_parent_tokens_and_extra_keys() -> None:
    a = hash_block(None, [1, 2, 3, 4], ("m",))
    assert a == hash_block(None, [1, 2, 3, 4], ("m",))
    assert a != hash_block(None, [1, 2, 3, 5], ("m",))
    assert a != hash_block(None, [1, 2, 3, 4], ("m", "salt:x"))
    assert hash_block(a, [5], ()) != hash_block(None, [5], ())


def test_prefix_hit_reuses_blocks_and_keeps_last_token_to_compute() -> None:
    pool = BlockPool(16)
    kv = KvCacheManager(pool, block_size=4)
    first = make_seq(list(range(12)))  # exactly 3 full blocks
    assert kv.allocate(first, 12) == []
    first.num_computed_tokens = 12
    kv.cache_full_blocks(first)
    assert pool.num_cached == 0 and len(pool.hash_to_block) == 3
    kv.free(first)
    assert pool.num_cached == 3
    second = make_seq(list(range(12)))
    hits = kv.find_cached_prefix(second)
    # 12 tokens: at most 11 may come from cache, so only 2 full blocks are reused.
    assert len(hits) == 2
    kv.allocate(second, 12 - 8, hits)
    assert second.num_computed_tokens == 8 and second.block_table[:2] == hits
    pool.check_integrity()
    salted = make_seq(list(range(12)), extra=("salt:b",))
    assert kv.find_cached_prefix(salted) == []


def test_copy_on_write_of_shared_partial_block() -> None:
    pool = BlockPool(8)
    kv = KvCacheManager(pool, block_size=4)
    parent = make_seq(list(range(6)))
    kv.allocate(parent, 6)
    parent.num_computed_tokens = 6
    child = make_seq(list(range(6)))
    kv.fork(parent, child)
    assert pool.blocks[parent.block_table[1]].ref_count == 2
    parent.token_ids.append(100)
    child.token_ids.append(200)
    copies = kv.allocate(child, 1)
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0]  # full block stays shared
    assert kv.allocate(parent, 1) == []  # now the only user: writes in place
    kv.free(parent)
    kv.free(child)
    assert pool.num_used == 0
    pool.check_integrity()


def test_eviction_is_lru_and_drops_hashes() -> None:
    pool = BlockPool(4, record_events=True)
    kv = KvCacheManager(pool, block_size=2)
    old = make_seq([1, 2, 3, 4])
    kv.allocate(old, 4)
    old.num_computed_tokens = 4
    kv.cache_full_blocks(old)
    kv.free(old)
    head, tail = old.block_hashes
    assert [type(e) for e in pool.take_events()] == [BlockStored, BlockStored]
    taken = pool.allocate(3)  # 2 free + 1 evicted (the tail block of `old`, freed first)
    assert pool.take_events() == [BlockRemoved(tail)]
    assert pool.num_cached == 1 and pool.lookup(head) is not None and pool.lookup(tail) is None
    pool.free(taken)
    pool.check_integrity()


def test_random_alloc_free_keeps_integrity() -> None:
    rng = random.Random(0)
    pool = BlockPool(64)
    kv = KvCacheManager(pool, block_size=4)
    live: list[Seq] = []
    for _ in range(2000):
        if live and rng.random() < 0.4:
            kv.free(live.pop(rng.randrange(len(live))))
        else:
            seq = make_seq([rng.randrange(8) for _ in range(rng.randrange(1, 20))])
            hits = kv.find_cached_prefix(seq)
            if kv.allocate(seq, seq.num_tokens - len(hits) * 4, hits) is None:
                continue
            seq.num_computed_tokens = seq.num_tokens
            kv.cache_full_blocks(seq)
            live.append(seq)
        kv.check_integrity(s.block_table for s in live)
    for seq in live:
        kv.free(seq)
    assert pool.num_used == 0
    kv.check_integrity()
