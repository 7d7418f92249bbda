"""Scheduler: token budget, chunked prefill, priority, preemption, admission."""

from __future__ import annotations

from refengine.config import SchedulerConfig
from refengine.kv.block_pool import BlockPool
from refengine.kv.kv_manager import KvCacheManager
from refengine.scheduler.scheduler import Scheduler
from refengine.scheduler.sequence import Sequence, SequenceStatus
from refengine.server.health import PROBE_PRIORITY


def make(num_blocks: int = 64, budget: int = 32, max_seqs: int = 8, block_size: int = 4) -> Scheduler:
    pool = BlockPool(num_blocks)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs),
                     KvCacheManager(pool, block_size))


def seq(rid: str, n: int, priority: int = 0) -> Sequence:
    return Sequence(rid, 0, list(range(1, n + 1)), n, priority=priority)


def run_step(s: Scheduler) -> dict[str, int]:
    """Schedule, pretend the model ran, append a token to sequences that sampled."""
    out = s.schedule()
    by_id = {q.request_id: q for q in s.running}
    sampled = [by_id[item.request_id] for item in out.scheduled if item.samples]
    s.update_from_output(out)
    for q in sampled:
        q.token_ids.append(7)
    return {item.request_id: item.num_new_tokens for item in out.scheduled}


def test_chunked_prefill_under_token_budget() -> None:
    s = make(budget=16)
    s.add(seq("a", 40))
    assert run_step(s) == {"a": 16}
    assert run_step(s) == {"a": 16}
    assert run_step(s) == {"a": 8}  # last chunk samples
    assert run_step(s) == {"a": 1}  # then decodes


def test_decodes_and_prefill_share_a_step() -> None:
    s = make(budget=16)
    s.add(seq("a", 4))
    run_step(s)
    s.add(seq("b", 30))
    assert run_step(s) == {"a": 1, "b": 15}


def test_priority_then_fcfs_admission() -> None:
    s = make(budget=8, max_seqs=1)
    s.add(seq("low", 4, priority=0))
    s.add(seq("high", 4, priority=5))
    s.add(seq("low2", 4, priority=0))
    assert list(run_step(s)) == ["high"]
    s.finish(s.running[0])
    assert list(run_step(s)) == ["low"]


def test_max_num_seqs_counts_slots_of_forking_parents() -> None:
    s = make(max_seqs=4)
    parent = seq("p", 4)
    parent.num_pending_forks = 2  # num_sequences = 3: two outputs wait for its prompt
    s.add(parent)
    s.add(seq("b", 4))
    s.add(seq("c", 4))
    assert sorted(run_step(s)) == ["b", "p"]


def test_fork_moves_a_pending_slot_and_shares_blocks() -> None:
    s = make(max_seqs=4, block_size=4)
    parent = seq("p", 6)
    parent.num_pending_forks = 1
    s.add(parent)
    run_step(s)  # the prompt is computed and output 0 sampled
    child = Sequence("p", 1, list(parent.token_ids[:6]), 6)
    s.fork(parent, child)
    assert parent.num_pending_forks == 0 and parent.num_slots + child.num_slots == 2
    assert child.block_table == parent.block_table and child.num_computed_tokens == 6
    assert all(s.kv.pool.blocks[b].ref_count == 2 for b in child.block_table)
    s.finish(parent)
    s.finish(child)
    s.kv.pool.check_integrity()
    assert s.kv.pool.num_used == 0


def test_preemption_frees_blocks_and_requeues() -> None:
    s = make(num_blocks=4, budget=64, block_size=4)
    a, b = seq("a", 7), seq("b", 7)
    s.add(a)
    s.add(b)
    run_step(s)  # both prefilled: 2 blocks each, pool full
    assert s.kv.pool.num_available == 0
    steps = [run_step(s) for _ in range(2)]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert "a" in steps[0]
    s.kv.pool.check_integrity()
    s.finish(a)
    assert "b" in run_step(s)  # recomputed once room is back
    s.kv.pool.check_integrity()


def test_admission_waits_for_room_without_skipping_the_head() -> None:
    s = make(num_blocks=4, budget=64, block_size=4)
    s.add(seq("big", 15))  # 4 blocks: the whole pool
    s.add(seq("small", 1))
    assert list(run_step(s)) == ["big"]
    assert list(run_step(s)) == ["big"]  # needs a 5th block? no: 16 slots; small still waits
    s.finish(s.running[0])
    assert list(run_step(s)) == ["small"]
    s.finish(s.running[0])
    assert s.kv.pool.num_used == 0


def test_a_health_probe_is_admitted_before_every_queued_request() -> None:
    """H3: the inference probe (PROBE_PRIORITY, above any int32 openengine-priority) waits for
    room, not behind the queue: a busy server that still serves answers its probe in time."""
    s = make(budget=8, max_seqs=1)
    s.add(seq("running", 4))
    run_step(s)
    s.add(seq("queued", 4, priority=2**31 - 1))
    s.add(seq("probe", 1, priority=PROBE_PRIORITY))
    s.finish(s.running[0])
    assert list(run_step(s)) == ["probe"]


def test_a_pull_is_ordered_while_decodes_use_the_whole_budget() -> None:
    """Decode role: a prompt whose KV arrives by pull computes nothing, so it is admitted (its
    blocks allocated, its pull ordered) even in a step whose token budget the running decodes
    use up; before, its pull waited for a decode to finish."""
    s = make(budget=2)
    s.add(seq("a", 3))
    s.add(seq("b", 3))
    run_step(s)  # both prefilled (3 + 3 > 2: over two steps)
    run_step(s)
    assert run_step(s) == {"a": 1, "b": 1}  # two decodes: the whole budget
    remote = Sequence("remote", 0, [5, 6, 7, 8, 9], 5, kv_from_remote=True)
    s.add(remote)
    out = s.schedule()
    assert [item.request_id for item in out.scheduled] == ["a", "b"]
    assert [load.request_id for load in out.kv_loads] == ["remote"] and remote.status == SequenceStatus.RECEIVING
    assert len(remote.block_table) == 2
