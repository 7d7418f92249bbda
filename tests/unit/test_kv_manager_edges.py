"""KV manager edge cases: check_integrity's leak and over-release reports, the usable-block count
under withhold, prefix lookup with caching off, copy-on-write for every partial fill, and free.

A mutation run over refengine/kv/kv_manager.py (comparisons flipped, constants moved, statements
deleted) found these behaviours untested; each test pins one rule stated by the module.
"""

from __future__ import annotations

import pytest

from refengine.config import SchedulerConfig
from refengine.kv.block_pool import BlockPool
from refengine.kv.kv_manager import KvCacheManager
from refengine.scheduler.scheduler import Scheduler
from refengine.scheduler.sequence import Sequence
from tests.unit.kv_helpers import Seq, compute


def test_manager_check_integrity_names_leaks_and_over_releases() -> None:
    """The manager's check compares each block's ref_count with its owners (sequence tables and
    named holdings): a table dropped without ``free`` is a leak, a table shared without
    ``touch`` an over-release, and a leak inside a named holding names that holding."""
    pool = BlockPool(4)
    kv = KvCacheManager(pool, block_size=2)
    a = Seq([1, 2, 3])
    compute(kv, a, 3)
    kv.check_integrity([a.block_table])
    with pytest.raises(AssertionError, match="leaked"):
        kv.check_integrity([])  # a table dropped without free
    with pytest.raises(AssertionError, match="over-released"):
        kv.check_integrity([a.block_table, a.block_table[:1]])  # shared without touch
    held = kv.transfer(a, "session")
    kv.check_integrity([])
    pool.blocks[held[0]].ref_count += 1
    with pytest.raises(AssertionError, match=r"leaked.*'session'"):
        kv.check_integrity([])
    pool.blocks[held[0]].ref_count -= 1
    assert kv.release("session") == len(held)
    kv.check_integrity([])
    assert pool.num_used == 0


def test_usable_blocks_start_at_pool_size_and_shrink_by_withheld() -> None:
    """The usable count starts at the pool size (nothing withheld) and shrinks by exactly the
    blocks withheld for good, while the freed head goes back to the pool; the scheduler's
    "can this ever fit" check depends on it."""
    pool = BlockPool(6)
    kv = KvCacheManager(pool, block_size=2)
    assert kv.num_usable_blocks == 6
    a = Seq([1, 2, 3, 4, 5])
    assert compute(kv, a, 5)
    assert len(kv.withhold(a, "q", 1)) == 2  # 3 blocks: the head freed, the tail held for good
    assert kv.num_usable_blocks == 6 - 2
    assert pool.num_used == 2  # the head went back to the pool


def test_caching_off_finds_no_prefix_and_scheduler_runs() -> None:
    """With caching off the prefix lookup returns an empty list, not None: the scheduler takes
    ``len()`` of the result, so an engine with prefix caching disabled would crash."""
    kv = KvCacheManager(BlockPool(8, enable_caching=False), block_size=4)
    assert kv.find_cached_prefix(Seq(list(range(9)))) == []
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4), kv)
    s.add(Sequence("a", 0, list(range(1, 10)), 9))
    out = s.schedule()
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 9)]


@pytest.mark.parametrize("num_tokens", [5, 6, 7])
def test_copy_on_write_for_every_partial_fill(num_tokens: int) -> None:
    """A forked child writing into a shared partial block gets its own copy, however many tokens
    that block holds (one, two or three of four). The rest of the suite only forks with two, so
    a child whose shared last block holds exactly one token could write into its parent's KV
    unnoticed."""
    pool = BlockPool(8)
    kv = KvCacheManager(pool, block_size=4)
    parent = Seq(list(range(num_tokens)))
    assert compute(kv, parent, num_tokens)
    child = Seq(list(parent.token_ids))
    kv.fork(parent, child)
    child.token_ids.append(99)
    copies = kv.allocate(child, 1)
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert parent.block_table[1] != child.block_table[1] and parent.block_table[0] == child.block_table[0]
    kv.check_integrity([parent.block_table, child.block_table])


def test_free_resets_the_sequence_and_manager_check_includes_pool_check() -> None:
    """``free`` empties the sequence's table and resets its computed count, so a preempted
    sequence recomputes from the start; and the manager's ``check_integrity`` also runs the
    pool's, so a pool-only corruption is still caught."""
    pool = BlockPool(4)
    kv = KvCacheManager(pool, block_size=2)
    a = Seq([1, 2, 3])
    assert compute(kv, a, 3)
    kv.free(a)
    assert a.block_table == [] and a.num_computed_tokens == 0
    pool.blocks[pool.free_block_ids[0]].sealed = True  # a pool-only corruption
    with pytest.raises(AssertionError, match="is sealed"):
        kv.check_integrity([])
