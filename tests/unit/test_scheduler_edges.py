"""Scheduler and sequence edge cases: empty steps, forks, admission (unfit prompts, the adapter
limit, the token budget, cached tokens), finishing from each queue, and Sequence's counts.
Preemption and KV pulls are in test_scheduler_preemption_edges.py.

A mutation run over refengine/scheduler/scheduler.py and sequence.py (comparisons flipped,
constants moved, statements deleted) found these behaviours untested; each test pins one rule
stated by the modules.
"""

from __future__ import annotations

import pytest

from refengine.config import SchedulerConfig
from refengine.scheduler.sequence import Sequence, SequenceStatus
from tests.unit.kv_helpers import make_sched, sseq, step


def test_is_empty() -> None:
    """A step with nothing scheduled is empty and one with work is not: the engine core skips
    the forward pass of a step whose output ``is_empty``."""
    s = make_sched()
    assert s.schedule().is_empty is True
    s.add(sseq("a", 3))
    assert s.schedule().is_empty is False


def test_fork_requires_a_pending_fork_slot_and_a_running_parent() -> None:
    """Only a running parent with a pending fork slot may fork, once per slot: a fork past
    ``num_pending_forks`` would over-commit ``max_num_seqs``."""
    s = make_sched()
    parent = sseq("p", 4)
    s.add(parent)
    with pytest.raises(AssertionError):  # waiting, no slot
        s.fork(parent, Sequence("p", 1, list(parent.token_ids), 4))
    parent.num_pending_forks = 1
    with pytest.raises(AssertionError):  # a slot, but not running yet
        s.fork(parent, Sequence("p", 1, list(parent.token_ids), 4))
    step(s)
    s.fork(parent, Sequence("p", 1, list(parent.token_ids[:4]), 4))
    with pytest.raises(AssertionError):  # running, but its one slot is used
        s.fork(parent, Sequence("p", 2, list(parent.token_ids[:4]), 4))


def test_fork_child_inherits_num_cached_tokens() -> None:
    """A forked child inherits its parent's cached-token count: the child reports the prompt's
    cached tokens in its usage."""
    s = make_sched(block_size=4)
    s.add(sseq("warm", 9))
    step(s)
    parent = sseq("p", 9)
    parent.num_pending_forks = 1
    s.add(parent)
    step(s)
    assert parent.num_cached_tokens == 8
    child = Sequence("p", 1, list(parent.token_ids[:9]), 9)
    s.fork(parent, child)
    assert child.num_cached_tokens == 8


def test_step_carries_the_copy_on_write_copies() -> None:
    """The step carries the copy-on-write copies its allocations made: the runner must copy the
    shared partial block before the child writes its first own token into the copy."""
    s = make_sched(block_size=4)
    parent = sseq("p", 6)
    parent.num_pending_forks = 1
    s.add(parent)
    step(s)
    child = Sequence("p", 1, list(parent.token_ids[:6]), 6)
    s.fork(parent, child)
    child.token_ids.append(8)
    shared = parent.block_table[1]
    out = s.schedule()
    # The first of the two to write (the parent: it is older) takes the copy.
    ((src, dst),) = out.block_copies
    assert src == shared and {parent.block_table[1], child.block_table[1]} == {shared, dst}


def test_unfit_boundary_after_withhold() -> None:
    """A waiting sequence that needs more blocks than the pool can ever hold now is ended
    (``out.unfit``) and the queue behind it goes on; one that needs exactly
    ``num_usable_blocks`` is admitted. Oracle: ceil(max(len, max_num_tokens) / block_size)."""
    s = make_sched(num_blocks=6, budget=64, block_size=4)
    hog = sseq("hog", 5)
    s.add(hog)
    step(s)
    s.kv.withhold(hog, "q", 0)  # 2 blocks gone for good: 4 usable
    s.running.remove(hog)
    assert s.kv.num_usable_blocks == 4
    too_long = sseq("too_long", 8, max_num_tokens=17)  # 5 blocks at its longest
    exact = sseq("exact", 8, max_num_tokens=16)  # 4 blocks: fits alone
    s.add(too_long)
    s.add(exact)
    out = s.schedule()
    assert out.unfit == [("too_long", 0)] and too_long.status is SequenceStatus.FINISHED
    assert [x.request_id for x in out.scheduled] == ["exact"]


def test_max_loras_bounds_distinct_running_adapters_and_steps_group_by_adapter() -> None:
    """At most ``max_loras`` distinct adapters run at once (the base model does not count), the
    queue head that would add one more waits and holds back those behind it, and a step's
    sequences are grouped by adapter in the order the scheduler itself keeps."""
    s = make_sched(budget=64, max_loras=1)
    seqs = [sseq("l2", 3, lora_key=2), sseq("base", 5), sseq("l1", 3, lora_key=1), sseq("l2b", 3, lora_key=2)]
    for q in seqs:
        s.add(q)
    out = s.schedule()
    # l2 admitted (first adapter), base always fits, l1 would be a 2nd adapter: the head waits there.
    assert sorted(x.request_id for x in out.scheduled) == ["base", "l2"]
    assert [x.request_id for x in out.scheduled] == ["base", "l2"]  # grouped: lora_key 0 before 2
    s.update_from_output(out)  # the step's order and the scheduler's own list must agree
    assert (seqs[0].num_computed_tokens, seqs[1].num_computed_tokens) == (3, 5)
    s.finish(seqs[0])
    out = s.schedule()
    assert sorted(x.request_id for x in out.scheduled) == ["base", "l1"]  # l2b waits behind l1
    assert [x.request_id for x in out.scheduled] == ["base", "l1"]


def test_num_cached_tokens_is_set_once_from_the_first_admission() -> None:
    """A sequence's cached-token count is the prefix-cache hit of its first admission: 0 for a
    cold prompt, the full cached blocks for a repeated one."""
    s = make_sched(budget=64, block_size=4)
    a = sseq("a", 9)
    s.add(a)
    step(s)
    assert a.num_cached_tokens == 0
    b = sseq("b", 9)  # same prompt: 2 full blocks from the cache (the last token is computed)
    s.add(b)
    assert step(s) == {"a": 1, "b": 1}
    assert b.num_cached_tokens == 8


def test_a_spent_budget_schedules_no_empty_entries() -> None:
    """No sequence, running or admitted, is scheduled with 0 tokens once the token budget is
    spent, and admission charges each admitted prompt against the budget."""
    s = make_sched(budget=3, max_seqs=4)
    for rid in "abc":
        s.add(sseq(rid, 1))
    assert step(s) == {"a": 1, "b": 1, "c": 1}
    s.config = SchedulerConfig(max_num_batched_tokens=2, max_num_seqs=4)
    s.add(sseq("d", 1))
    assert step(s) == {"a": 1, "b": 1}  # c not scheduled at all, d not admitted
    s = make_sched(budget=8, max_seqs=4)
    s.add(sseq("x", 8))
    s.add(sseq("y", 8))
    assert step(s) == {"x": 8}


def test_finish_removes_a_sequence_from_each_queue() -> None:
    """Finishing (aborting) a waiting or receiving sequence takes it out of its queue and marks
    it FINISHED; otherwise it is scheduled after its request ended, or holds a running slot for
    ever. A receiving sequence must first hand its blocks to its pull."""
    s = make_sched(budget=64, max_seqs=2)
    waiting = sseq("w", 3)
    s.add(waiting)
    s.finish(waiting)
    assert waiting.status is SequenceStatus.FINISHED and s.waiting == []
    assert s.schedule().is_empty
    remote = Sequence("r", 0, [5, 6, 7, 8, 9], 5, kv_from_remote=True)
    s.add(remote)
    out = s.schedule()
    assert remote.status is SequenceStatus.RECEIVING and len(out.kv_loads) == 1
    with pytest.raises(AssertionError):  # its blocks must be handed to its pull first
        s.finish(remote)
    s.kv.transfer(remote, "load")
    s.finish(remote)
    assert remote.status is SequenceStatus.FINISHED and s.receiving == []
    s.kv.release("load")
    s.add(sseq("a", 2))
    s.add(sseq("b", 2))
    assert step(s) == {"a": 2, "b": 2}  # both slots free again
    s.kv.check_integrity(q.block_table for q in s.running)


def test_sequence_counts() -> None:
    """A sequence's output count is its tokens past the prompt (the stop checker's max_tokens and
    min_tokens depend on it), and a higher priority sorts first."""
    q = Sequence("a", 0, [1, 2, 3, 4, 5], 3, num_computed_tokens=2, num_pending_forks=2)
    assert (q.num_tokens, q.num_output_tokens, q.num_uncomputed_tokens, q.num_slots) == (5, 2, 3, 3)
    assert Sequence("b", 0, [1], 1, priority=2).sort_key[0] == -2
