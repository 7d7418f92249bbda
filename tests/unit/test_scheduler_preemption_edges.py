"""Scheduler edge cases of preemption and KV pulls: recomputation after preemption, sequences that
cannot recompute, the running order and the choice of victim, and receiving sequences (their
running slot, their admission, a cached head, finish_receiving).

A mutation run over refengine/scheduler/scheduler.py and kv_manager.py (comparisons flipped,
constants moved, statements deleted) found these behaviours untested; each test pins one rule
stated by the modules.
"""

from __future__ import annotations

from refengine.config import SchedulerConfig
from refengine.scheduler.sequence import Sequence, SequenceStatus
from tests.unit.kv_helpers import make_sched, sseq, step


def test_preempted_sequence_recomputes_its_whole_prompt() -> None:
    """A preempted sequence (no prefix-cache hit: the cache is off) starts again from token 0,
    all of it in one chunk when the budget allows; ``free`` must reset its computed count."""
    s = make_sched(num_blocks=4, budget=64, block_size=4, caching=False)
    a, b = sseq("a", 7), sseq("b", 7)
    s.add(a)
    s.add(b)
    step(s)
    step(s)  # a decodes into its 2nd block's last slot; b too
    step(s)  # a needs a 3rd block: b (same priority, newer) is preempted
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    s.finish(a)
    n = b.num_tokens
    assert step(s) == {"b": n}


def test_preempted_non_recomputable_sequence_is_reported_lost() -> None:
    """A preempted sequence that cannot recompute is ended and reported in ``out.lost`` (once);
    without it its request never ends."""
    s = make_sched(num_blocks=4, budget=64, block_size=4)
    a, b = sseq("a", 7), sseq("b", 7, recomputable=False)
    s.add(a)
    s.add(b)
    step(s)
    step(s)
    out = s.schedule()  # a needs a 3rd block: b is preempted, and cannot recompute
    assert out.lost == [("b", 0)] and b.status is SequenceStatus.FINISHED
    assert b not in s.waiting and b.block_table == []
    s.update_from_output(out)
    assert s.schedule().lost == []


def test_running_order_is_priority_each_step() -> None:
    """The running list is re-sorted by priority every step: a higher-priority sequence admitted
    after a lower one is served first once the budget is short."""
    s = make_sched(budget=1, max_seqs=4)
    low = sseq("low", 1)
    s.add(low)
    step(s)
    high = sseq("high", 1, priority=5)
    s.add(high)
    step(s)  # low decodes (the whole budget), high waits: budget 0
    s.config = SchedulerConfig(max_num_batched_tokens=2, max_num_seqs=4)
    step(s)  # low decodes, high is admitted after it (1 token)
    s.config = SchedulerConfig(max_num_batched_tokens=1, max_num_seqs=4)
    assert step(s) == {"high": 1}


def test_preemption_takes_the_lowest_priority_newest_and_never_a_scheduled_one() -> None:
    """The victim is the last running sequence; when that is the one asking, it preempts itself
    and the loop stops (never preempting one already in this step), and after a victim is freed
    the asking sequence gets its blocks."""
    # The asker is not the victim: a (older) needs a 3rd block, b goes.
    s = make_sched(num_blocks=4, budget=64, block_size=4)
    a, b = sseq("a", 7), sseq("b", 7)
    s.add(a)
    s.add(b)
    step(s)
    step(s)
    assert step(s) == {"a": 1}
    assert b.status is SequenceStatus.WAITING and len(a.block_table) == 3
    # The asker is the victim: a fits, b (last) needs a block.
    s = make_sched(num_blocks=4, budget=64, block_size=4)
    a, b = sseq("a", 6), sseq("b", 7)
    s.add(a)
    s.add(b)
    step(s)
    step(s)
    assert step(s) == {"a": 1}
    assert a.status is SequenceStatus.RUNNING and b.status is SequenceStatus.WAITING
    s.kv.check_integrity(q.block_table for q in s.running)


def test_num_cached_tokens_is_not_overwritten_by_a_readmission() -> None:
    """The cached-token count is set at the first admission only: a preempted sequence
    re-admitted on cache hits of its own blocks still reports what its prompt first found."""
    s = make_sched(num_blocks=6, budget=64, block_size=4)
    a, b = sseq("a", 7, priority=1), sseq("b", 9)
    s.add(a)
    s.add(b)
    step(s)  # a: 2 blocks, b: 3 blocks (2 full, published); both first admissions: 0 cached
    assert b.num_cached_tokens == 0
    while b.status is SequenceStatus.RUNNING:
        step(s)  # a grows until b is preempted
    s.finish(a)
    step(s)  # b re-admitted: its 2 full blocks are cache hits now
    assert b.status is SequenceStatus.RUNNING and b.num_cached_tokens == 0


def test_a_receiving_sequence_holds_a_running_slot() -> None:
    """A prompt whose KV is being pulled counts against ``max_num_seqs``."""
    s = make_sched(budget=64, max_seqs=1)
    remote = Sequence("r", 0, [5, 6, 7, 8, 9], 5, kv_from_remote=True)
    s.add(remote)
    s.schedule()
    assert remote.status is SequenceStatus.RECEIVING
    s.add(sseq("a", 2))
    out = s.schedule()
    assert out.scheduled == [] and s.waiting[0].request_id == "a"


def test_receiving_admission_continues_the_queue_and_counts_its_slot() -> None:
    """After a receiving sequence is admitted the queue goes on (same step) and its slot counts
    at once; one the pool cannot hold waits at the head."""
    s = make_sched(budget=64, max_seqs=2)
    s.add(Sequence("r", 0, [5, 6, 7, 8, 9], 5, kv_from_remote=True))
    s.add(sseq("a", 2))
    s.add(sseq("b", 2))
    out = s.schedule()
    assert [x.request_id for x in out.kv_loads] == ["r"]
    assert [x.request_id for x in out.scheduled] == ["a"]  # b: both slots taken (r and a)
    s = make_sched(num_blocks=3, budget=64, max_seqs=4)
    s.add(sseq("hog", 2))
    step(s)  # 1 block used
    s.add(Sequence("big", 0, list(range(1, 10)), 9, kv_from_remote=True))  # 3 blocks > 2 free
    s.add(sseq("a", 2))
    out = s.schedule()
    assert out.kv_loads == [] and [x.request_id for x in out.scheduled] == ["hog"]
    assert [q.request_id for q in s.waiting] == ["big", "a"]


def test_receiving_with_a_cached_head_then_finish_receiving() -> None:
    """A receiving sequence's cached head is not pulled, the rest of the prompt is; once the pull
    ended the sequence runs from a full prompt, decodes one token, its blocks are published,
    and a later preemption recomputes locally."""
    s = make_sched(budget=64, block_size=4)
    s.add(sseq("warm", 9))
    step(s)  # publishes the 2 full blocks of tokens 1..8
    hits = s.running[0].block_table[:2]
    s.finish(s.running[0])  # its blocks stay cached
    remote = Sequence("r", 0, list(range(1, 11)) + [50, 51, 52], 13, kv_from_remote=True)
    s.add(remote)
    out = s.schedule()
    assert out.scheduled == []
    s.update_from_output(out)
    (load,) = out.kv_loads
    assert (load.request_id, load.first_block_index) == ("r", 2)
    assert remote.block_table[:2] == hits and len(remote.block_table) == 4  # ceil(13 / 4)
    assert load.dest_block_ids == tuple(remote.block_table[2:])
    assert remote.num_cached_tokens == 8 and s.receiving == [remote]
    s.finish_receiving(remote)
    assert remote.status is SequenceStatus.RUNNING and remote in s.running and s.receiving == []
    assert remote.num_computed_tokens == 13 and remote.kv_from_remote is False
    assert len(remote.block_hashes) == 3 and all(h in s.kv.pool.hash_to_block for h in remote.block_hashes)
    remote.token_ids.append(60)
    assert step(s) == {"r": 1}
    s.kv.check_integrity(q.block_table for q in s.running)
