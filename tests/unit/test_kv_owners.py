"""KV owners: sequences and named holdings (transfer / release), reference-count integrity."""

from __future__ import annotations

import random

import pytest

from refengine.kv.block_pool import BlockPool
from refengine.kv.kv_manager import KvCacheManager
from tests.unit.kv_helpers import Seq

BLOCK_SIZE = 4



def make_kv(num_blocks: int) -> KvCacheManager:
    return KvCacheManager(BlockPool(num_blocks), BLOCK_SIZE)


def admit(kv: KvCacheManager, tokens: list[int]) -> Seq | None:
    """Admit a sequence with its prefix-cache hits and compute all its tokens."""
    seq = Seq(list(tokens))
    hits = kv.find_cached_prefix(seq)
    if kv.allocate(seq, len(tokens) - len(hits) * BLOCK_SIZE, hits) is None:
        return None
    seq.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(seq)
    return seq


def decode(kv: KvCacheManager, seq: Seq, token: int) -> bool:
    """Append one token and compute it (copy-on-write of a shared partial block included)."""
    seq.token_ids.append(token)
    if kv.allocate(seq, 1) is None:
        seq.token_ids.pop()
        return False
    seq.num_computed_tokens += 1
    kv.cache_full_blocks(seq)
    return True


def assert_idle(kv: KvCacheManager) -> None:
    pool = kv.pool
    assert pool.num_used == 0 and len(pool.free_block_ids) + pool.num_cached == pool.num_blocks
    assert kv.owners == ()
    kv.check_integrity()


def test_transfer_keeps_ref_counts_and_release_returns_to_idle() -> None:
    kv = make_kv(16)
    seq = admit(kv, list(range(10)))
    assert seq is not None
    table = list(seq.block_table)
    ref_counts = [kv.pool.blocks[b].ref_count for b in table]
    held = kv.transfer(seq, "session:a")
    assert held == tuple(table) and kv.held_block_ids("session:a") == held
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert [kv.pool.blocks[b].ref_count for b in table] == ref_counts
    assert kv.owners == ("session:a",)
    kv.check_integrity()
    assert kv.release("session:a") == 3
    assert_idle(kv)


def test_transferred_prefix_is_a_cache_hit_while_held_and_after_release() -> None:
    kv = make_kv(16)
    prefill = admit(kv, list(range(12)))
    assert prefill is not None
    held = kv.transfer(prefill, "session:a")
    reader = Seq(list(range(12)) + [99])
    assert kv.find_cached_prefix(reader) == list(held)  # all 3 full blocks hit
    kv.release("session:a")
    assert kv.pool.num_cached == 3  # released: cached and evictable, not freed
    reuser = admit(kv, list(range(12)) + [7])
    assert reuser is not None and reuser.block_table[:3] == list(held)
    kv.check_integrity([reuser.block_table])
    kv.free(reuser)
    assert_idle(kv)


def test_fork_child_survives_transfer_of_parent() -> None:
    kv = make_kv(16)
    parent = admit(kv, list(range(6)))  # one full block + a partial one
    assert parent is not None
    child = Seq(list(parent.token_ids))
    kv.fork(parent, child)
    held = kv.transfer(parent, "session:p")
    assert all(kv.pool.blocks[b].ref_count == 2 for b in held)
    kv.check_integrity([child.block_table])
    assert decode(kv, child, 100)  # the shared partial block is copied, not written
    assert child.block_table[0] == held[0] and child.block_table[1] != held[1]
    kv.check_integrity([child.block_table])
    kv.release("session:p")
    kv.check_integrity([child.block_table])
    kv.free(child)
    assert_idle(kv)


def test_owner_names_are_checked() -> None:
    kv = make_kv(8)
    first, second = admit(kv, [1, 2, 3]), admit(kv, [4, 5, 6])
    assert first is not None and second is not None
    kv.transfer(first, "s")
    with pytest.raises(ValueError, match="'s' already holds"):
        kv.transfer(second, "s")
    assert second.block_table  # a refused transfer changes nothing
    kv.release("s")
    with pytest.raises(KeyError, match="already released"):
        kv.release("s")
    with pytest.raises(KeyError, match="no KV owner 'x'"):
        kv.held_block_ids("x")
    kv.free(second)
    assert_idle(kv)


def test_integrity_names_a_leaked_and_an_over_released_block() -> None:
    kv = make_kv(8)
    kept, dropped = admit(kv, [1, 2, 3, 4, 5]), admit(kv, [9, 9, 9])
    assert kept is not None and dropped is not None
    kv.check_integrity([kept.block_table, dropped.block_table])
    (leaked,) = dropped.block_table
    with pytest.raises(AssertionError, match=f"KV block {leaked} leaked: ref_count 1, but 0 references"):
        kv.check_integrity([kept.block_table])  # `dropped` forgotten without free
    kv.free(dropped)
    kv.transfer(kept, "s")
    kv.pool.free([kv.held_block_ids("s")[-1]])  # freed behind the owner's back
    with pytest.raises(AssertionError, match=r"over-released: ref_count 0, but 1 references .*\['s'\]"):
        kv.check_integrity()


@pytest.mark.parametrize("seed", range(5))
def test_random_owner_operations_keep_integrity(seed: int) -> None:
    rng = random.Random(seed)
    kv = make_kv(48)
    live: list[Seq] = []
    owners: list[str] = []
    for step in range(400):
        op = rng.random()
        if op < 0.3 or not live:
            # A small alphabet and shared heads make prefix hits and duplicates common.
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 4) * BLOCK_SIZE)]
            tokens += [rng.randrange(50) for _ in range(rng.randrange(0, 7))]
            seq = admit(kv, tokens)
            if seq is not None:
                live.append(seq)
        elif op < 0.5:
            seq = rng.choice(live)
            for _ in range(rng.randrange(1, 6)):
                if not decode(kv, seq, rng.randrange(50)):
                    break
        elif op < 0.6:
            parent = rng.choice(live)
            child = Seq(list(parent.token_ids))
            kv.fork(parent, child)
            live.append(child)
        elif op < 0.75:
            name = f"session:{step}"
            kv.transfer(live.pop(rng.randrange(len(live))), name)
            owners.append(name)
        elif op < 0.9 and owners:
            kv.release(owners.pop(rng.randrange(len(owners))))
        else:
            kv.free(live.pop(rng.randrange(len(live))))
        kv.check_integrity(s.block_table for s in live)
        assert sorted(kv.owners) == sorted(owners)
    for seq in live:
        kv.free(seq)
    for name in owners:
        kv.release(name)
    assert_idle(kv)
