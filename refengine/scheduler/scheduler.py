"""The continuous-batching scheduler (vLLM v1 style).

Each step gets a token budget (``max_num_batched_tokens``). Running sequences are
served first, in priority order, each taking as many of its uncomputed tokens as
the budget allows (a decode takes 1, a prefill chunk takes the rest). When the pool
cannot hold a running sequence's next tokens, the lowest-priority, newest running
sequence is preempted by recompute: its blocks are freed and it goes back to the
waiting queue with its tokens, to be recomputed later (mostly from the prefix
cache). New sequences are admitted in priority order, FCFS within a priority, only
when no preemption happened this step, and never past the head of the queue, so
admission is fair and cannot deadlock: every admitted sequence fits the pool
alone (the engine rejects those that never could).

The scheduler decides counts; it never touches tensors. ``schedule`` returns what
to run; ``update_after_step`` advances ``num_computed_tokens`` once it ran.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from refengine.config import SchedulerConfig
from refengine.kv.kv_manager import KvCacheManager
from refengine.scheduler.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step: tokens ``start … start + num_new_tokens - 1``.

    ``samples``: the step computes the sequence's newest token, so its logits give
    the next token (fixed at scheduling time; the sequence grows afterwards).
    """

    seq: Sequence
    num_new_tokens: int
    start: int
    samples: bool

    @classmethod
    def of(cls, seq: Sequence, num_new_tokens: int) -> ScheduledSequence:
        start = seq.num_computed_tokens
        return cls(seq, num_new_tokens, start, start + num_new_tokens == seq.num_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), run before the step
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KvCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []  # sorted by Sequence.sort_key at each step

    # -- membership ----------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def add_running(self, seq: Sequence) -> None:
        """A fork child: it already shares its parent's blocks."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove ``seq`` wherever it is and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.kv.free(seq)

    def fits_alone(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` could ever hold all its KV."""
        return self.kv.num_blocks_for(num_tokens) <= self.kv.pool.num_blocks

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step ------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=lambda s: s.sort_key)

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            copies = self.kv.allocate(seq, num_new)
            while copies is None:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
                copies = self.kv.allocate(seq, num_new)
            if copies is None:
                break
            out.block_copies.extend(copies)
            out.scheduled.append(ScheduledSequence.of(seq, num_new))
            budget -= num_new
            i += 1

        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        num_running_slots = sum(s.seq_slots for s in self.running)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if num_running_slots + seq.seq_slots > self.config.max_num_seqs:
                break
            cached_block_ids = self.kv.find_cached_prefix(seq) if seq.use_prefix_cache else []
            num_cached_tokens = len(cached_block_ids) * self.kv.block_size
            num_new = min(seq.num_tokens - seq.num_computed_tokens - num_cached_tokens, budget)
            copies = self.kv.allocate(seq, num_new, cached_block_ids)
            if copies is None:
                break
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = min(num_cached_tokens, seq.num_prompt_tokens)
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_running_slots += seq.seq_slots
            out.block_copies.extend(copies)
            out.scheduled.append(ScheduledSequence.of(seq, num_new))
            budget -= num_new

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_preemptions += 1
        out.preempted.append(seq)
        self.add(seq)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """The step ran: its tokens' KV is in the cache. Publish newly full blocks."""
        for scheduled in out.scheduled:
            seq = scheduled.seq
            seq.num_computed_tokens += scheduled.num_new_tokens
            # Even a request that bypassed the cache publishes what it computed (K1).
            self.kv.cache_full_blocks(seq)
