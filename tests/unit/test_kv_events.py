"""The ordered KV event queue: stored parent-before-child, removals on eviction, reset."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from refengine.kv.block_pool import BlockPool
from refengine.kv.kv_manager import KvCacheManager
from refengine.types import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

BLOCK_SIZE = 4
EXTRA = ("model:abc", "salt:x")


@dataclass(eq=False)
class Seq:
    """A minimal KvSequence (the kv package does not depend on the scheduler)."""

    token_ids: list[int]
    extra_keys: tuple[str, ...] = EXTRA
    lora: None = None
    media_spans: tuple = ()
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)


def make_kv(num_blocks: int, record_events: bool = True) -> KvCacheManager:
    return KvCacheManager(BlockPool(num_blocks, record_events=record_events), BLOCK_SIZE)


def compute(kv: KvCacheManager, seq: Seq, num_tokens: int) -> bool:
    """Compute the next ``num_tokens`` of ``seq`` (one scheduler step for it)."""
    if kv.allocate(seq, num_tokens) is None:
        return False
    seq.num_computed_tokens += num_tokens
    kv.cache_full_blocks(seq)
    return True


def stored(events: list[KvEvent]) -> list[BlockStored]:
    assert all(isinstance(e, BlockStored) for e in events), events
    return [e for e in events if isinstance(e, BlockStored)]


def assert_chain(events: list[BlockStored], tokens: list[int]) -> None:
    """Events i = blocks i of ``tokens``, each chained onto the previous one."""
    assert len(events) == len(tokens) // BLOCK_SIZE
    for i, event in enumerate(events):
        assert event.parent_hash == (events[i - 1].block_hash if i else None)
        assert event.token_ids == tuple(tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
        assert event.block_size == BLOCK_SIZE and event.extra_keys == EXTRA


def test_full_blocks_are_stored_parent_before_child() -> None:
    kv = make_kv(8)
    seq = Seq(list(range(13)))  # 3 full blocks + 1 token
    compute(kv, seq, 13)
    events = stored(kv.pool.take_events())
    assert_chain(events, seq.token_ids)
    assert [e.block_hash for e in events] == seq.block_hashes[:3]
    assert kv.pool.take_events() == []  # taken means cleared
    compute(kv, seq, 0)
    assert kv.pool.take_events() == []  # nothing new, nothing re-announced


@pytest.mark.parametrize("chunk", [1, 3, 5, 9])
def test_chunked_computing_stores_each_block_once_in_order(chunk: int) -> None:
    kv = make_kv(8)
    seq = Seq([t * 7 % 11 for t in range(22)])
    events: list[BlockStored] = []
    while seq.num_computed_tokens < len(seq.token_ids):
        compute(kv, seq, min(chunk, len(seq.token_ids) - seq.num_computed_tokens))
        events += stored(kv.pool.take_events())
        assert len(events) == seq.num_computed_tokens // BLOCK_SIZE
    assert_chain(events, seq.token_ids)


def test_eviction_emits_removed_for_exactly_the_evicted_hash() -> None:
    kv = make_kv(4)
    old = Seq(list(range(8)))
    compute(kv, old, 8)
    kv.free(old)
    kv.pool.take_events()
    assert kv.pool.num_cached == 2
    new = Seq([50, 51, 52, 53, 54])
    compute(kv, new, 5)  # the 2 free blocks suffice: nothing evicted
    assert [type(e) for e in kv.pool.take_events()] == [BlockStored]
    taken = kv.pool.allocate(1)  # evicts the LRU cached block: `old`'s tail, freed first
    assert kv.pool.take_events() == [BlockRemoved(old.block_hashes[1])]
    assert kv.pool.lookup(old.block_hashes[0]) is not None
    kv.pool.free(taken)
    kv.check_integrity([new.block_table])


def test_reset_emits_one_all_cleared_and_unpublishes_blocks_in_use() -> None:
    kv = make_kv(16)
    done, running = Seq(list(range(8))), Seq(list(range(100, 112)))
    compute(kv, done, 8)
    compute(kv, running, 9)  # 2 full blocks published, still in use
    kv.free(done)
    kv.pool.take_events()
    assert kv.pool.reset_prefix_cache() == 2  # the cached blocks of `done`
    assert kv.pool.take_events() == [AllBlocksCleared()]
    assert kv.pool.hash_to_block == {} and kv.pool.num_cached == 0
    assert all(kv.pool.blocks[b].block_hash is None for b in running.block_table)
    kv.check_integrity([running.block_table])
    compute(kv, running, 3)  # block 2 becomes full, but its parent is no longer published
    assert kv.pool.take_events() == [] and kv.pool.hash_to_block == {}
    kv.free(running)
    assert len(kv.pool.free_block_ids) == kv.pool.num_blocks  # nothing stayed cached
    again = Seq(list(range(100, 112)))
    compute(kv, again, 12)
    assert_chain(stored(kv.pool.take_events()), again.token_ids)  # a fresh start publishes again
    kv.check_integrity([again.block_table])


def test_without_recording_or_caching_nothing_is_kept() -> None:
    silent = make_kv(4, record_events=False)
    uncached = KvCacheManager(BlockPool(4, enable_caching=False, record_events=True), BLOCK_SIZE)
    for kv in (silent, uncached):
        seq = Seq(list(range(8)))
        compute(kv, seq, 8)
        kv.free(seq)
        kv.pool.allocate(4)
        kv.pool.reset_prefix_cache()
        assert kv.pool.take_events() == []
    assert silent.pool._events is None


def test_concurrent_duplicates_store_one_event_per_hash() -> None:
    kv = make_kv(16)
    first, second = Seq(list(range(9))), Seq(list(range(9)))
    compute(kv, first, 5)  # both computed in the same steps: no cache hit for `second`
    compute(kv, second, 5)
    compute(kv, first, 4)
    compute(kv, second, 4)
    events = stored(kv.pool.take_events())
    assert_chain(events, first.token_ids)  # 2 blocks, once each
    assert set(first.block_table).isdisjoint(second.block_table)
    second.token_ids += [1, 2, 3, 4]
    compute(kv, second, 4)  # its own parent is a duplicate: `first`'s block holds the parent hash
    assert kv.pool.take_events() == [], "a child whose parent block is another's copy stays unpublished"
    kv.check_integrity([first.block_table, second.block_table])
    # Were it published, evicting `first`'s blocks (nobody else holds them) would leave it an
    # orphan: announced as cached, its parent removed, reachable by no lookup (E2, E4).
    kv.free(first)
    taken = kv.pool.allocate(kv.pool.num_available)
    view = View()
    view.apply(kv.pool.snapshot())
    assert all(parent is None or parent in view.blocks for parent in view.blocks.values())
    assert set(view.blocks) == set(kv.pool.hash_to_block)
    kv.pool.free(taken)


def test_no_child_is_stored_after_its_parent_was_evicted() -> None:
    kv = make_kv(6)
    first, second = Seq(list(range(5))), Seq(list(range(5)))
    compute(kv, first, 5)
    compute(kv, second, 5)  # a duplicate of `first`'s block 0: not published
    kv.free(first)
    kv.pool.take_events()
    taken = kv.pool.allocate(kv.pool.num_available)  # evicts `first`'s published block 0
    assert kv.pool.take_events() == [BlockRemoved(second.block_hashes[0])]
    kv.pool.free(taken)
    second.token_ids += [8, 8, 8]
    compute(kv, second, 3)
    assert kv.pool.take_events() == []  # its parent hash is gone: the block stays unpublished
    kv.check_integrity([second.block_table])


class View:
    """A subscriber: replays the event stream into {block_hash: parent_hash}."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, bytes | None] = {}

    def apply(self, events: list[KvEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                assert event.block_hash not in self.blocks, "stored twice"
                assert event.parent_hash is None or event.parent_hash in self.blocks, "child before parent"
                self.blocks[event.block_hash] = event.parent_hash
            elif isinstance(event, BlockRemoved):
                del self.blocks[event.block_hash]
            else:
                self.blocks.clear()


@pytest.mark.parametrize("seed", range(5))
def test_random_event_stream_replays_to_the_published_set(seed: int) -> None:
    rng = random.Random(seed)
    kv = make_kv(24)  # small: evictions are frequent
    view = View()
    live: list[Seq] = []
    for _ in range(500):
        op = rng.random()
        if op < 0.25 or not live:
            # Few distinct heads: concurrent duplicates and prefix hits are common.
            seq = Seq([rng.randrange(2) for _ in range(rng.randrange(2, 14))])
            hits = kv.find_cached_prefix(seq)
            num_new = min(rng.randrange(1, 9), len(seq.token_ids) - len(hits) * BLOCK_SIZE)
            if kv.allocate(seq, num_new, hits) is not None:
                seq.num_computed_tokens += num_new
                kv.cache_full_blocks(seq)
                live.append(seq)
        elif op < 0.7:
            seq = rng.choice(live)
            seq.token_ids += [rng.randrange(2) for _ in range(rng.randrange(0, 3))]
            remaining = len(seq.token_ids) - seq.num_computed_tokens
            compute(kv, seq, min(rng.randrange(1, 6), remaining))
        elif op < 0.8:
            parent = rng.choice(live)
            child = Seq(list(parent.token_ids))
            kv.fork(parent, child)
            live.append(child)
        elif op < 0.98:
            kv.free(live.pop(rng.randrange(len(live))))
        else:
            kv.pool.reset_prefix_cache()
        view.apply(kv.pool.take_events())
        assert view.blocks.keys() == kv.pool.hash_to_block.keys()
        kv.check_integrity(s.block_table for s in live)


def test_each_full_block_is_offered_once_even_when_not_published() -> None:
    kv = make_kv(16)
    first, second = Seq(list(range(12))), Seq(list(range(12)))
    compute(kv, first, 12)
    compute(kv, second, 12)  # 3 duplicates: sealed, not published
    offered: list[int] = []
    cache_block = kv.pool.cache_block
    kv.pool.cache_block = lambda block_id, *args: offered.append(block_id) or cache_block(block_id, *args)  # type: ignore[method-assign]
    for token in range(20):
        second.token_ids.append(token)
        compute(kv, second, 1)
    # Only the 5 blocks that became full are offered: no step rescans the duplicate head.
    assert offered == second.block_table[3:8]
