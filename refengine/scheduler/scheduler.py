"""The continuous-batching scheduler (vLLM v1 style).

Each step gets a token budget (``max_num_batched_tokens``). Running sequences are
served first, in priority order, each taking as many of its uncomputed tokens as
the budget allows (a decode takes 1, a prefill chunk takes the rest). When the pool
cannot hold a running sequence's next tokens, the lowest-priority, newest running
sequence is preempted by recompute: its blocks are freed and it goes back to the
waiting queue with its tokens, to be recomputed later (mostly from the prefix
cache); one that cannot be recomputed here (``Sequence.recomputable``) is ended
instead (``SchedulerOutput.lost``). New sequences are admitted in priority order, FCFS within a priority, only
when no preemption happened this step, and never past the head of the queue, so
admission is fair and cannot deadlock: every admitted sequence fits the pool
alone (the engine rejects those that never could, and the scheduler ends those that no
longer can, once blocks are withheld for good).

LoRA: the running (and receiving) sequences use at most ``max_loras`` distinct adapters,
so every step's adapters fit the device's slots. A waiting sequence whose adapter would be
one too many waits at the head of the queue until the running ones of some adapter finish
(they always do: each is bounded by its ``max_tokens``).

The scheduler decides counts; it never touches tensors. ``schedule`` returns what
to run; ``update_from_output`` advances ``num_computed_tokens`` once it ran and
publishes the blocks that became full.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from refengine.config import SchedulerConfig
from refengine.kv.kv_manager import KvCacheManager
from refengine.scheduler.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step, as plain data: its tokens ``start … start +
    num_new_tokens - 1`` (``token_ids``) and its block table as it is for this step.

    ``samples``: the step computes the sequence's newest token, so its logits give
    the next token (fixed at scheduling time; the sequence grows afterwards).
    """

    request_id: str
    index: int  # output index within the request
    start: int
    num_new_tokens: int
    samples: bool
    token_ids: tuple[int, ...]
    block_table: tuple[int, ...]

    @classmethod
    def of(cls, seq: Sequence, num_new_tokens: int) -> ScheduledSequence:
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        return cls(seq.request_id, seq.index, start, num_new_tokens, end == seq.num_tokens,
                   tuple(seq.token_ids[start:end]), tuple(seq.block_table))


@dataclass(frozen=True)
class KvLoad:
    """A sequence admitted to receive its prompt's KV from elsewhere: blocks
    ``first_block_index …`` of its table (``dest_block_ids``) are to be filled; the blocks
    before them were prefix-cache hits here."""

    request_id: str
    first_block_index: int
    dest_block_ids: tuple[int, ...]


@dataclass
class SchedulerOutput:
    """What one step runs: plain data, safe to hand to the runner (or to other ranks)."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), run before the step
    kv_loads: list[KvLoad] = field(default_factory=list)  # pulls to start (decode role)
    # Sequences preempted that cannot recompute (``Sequence.recomputable``): out of the
    # scheduler, blocks freed; the engine ends their requests.
    lost: list[tuple[str, int]] = field(default_factory=list)  # (request_id, index)
    # Waiting sequences longer than the pool can ever hold now (``KvCacheManager.withhold``
    # shrank it): out of the scheduler, never admitted; the engine ends their requests.
    unfit: list[tuple[str, int]] = field(default_factory=list)  # (request_id, index)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KvCacheManager, max_loras: int = 0) -> None:
        self.config = config
        self.kv = kv
        self.max_loras = max_loras
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []  # sorted by Sequence.sort_key at each step
        self.receiving: list[Sequence] = []  # admitted, their prompt's KV being pulled (never preempted)
        self._scheduled: list[Sequence] = []  # the sequences of the last schedule(), in order
        self._lost: list[tuple[str, int]] = []  # this schedule()'s preempted non-recomputable sequences

    # -- membership ----------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start ``child`` running on ``parent``'s computed blocks (copy-on-write later). KV-only:
        the child's tokens are already the parent's; it takes over one of the parent's
        pending-fork slots."""
        assert parent.num_pending_forks > 0 and parent.status is SequenceStatus.RUNNING
        self.kv.fork(parent, child)
        child.num_cached_tokens = parent.num_cached_tokens
        parent.num_pending_forks -= 1
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    def finish(self, seq: Sequence) -> None:
        """Remove ``seq`` wherever it is and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.RECEIVING:  # its blocks must have left it (a pull may still write)
            assert not seq.block_table, "a receiving sequence's blocks are handed to its pull before finishing"
            self.receiving.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.kv.free(seq)

    # -- one step ------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._scheduled = []
        out.lost = self._lost = []
        preempted = False
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=lambda s: s.sort_key)

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            copies = self.kv.allocate(seq, num_new)
            while copies is None:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
                copies = self.kv.allocate(seq, num_new)
            if copies is None:
                break
            self._add_to_step(out, seq, num_new, copies)
            budget -= num_new
            i += 1

        if not preempted:
            self._admit_waiting(out, budget)
        if self.max_loras:
            self._group_by_adapter(out)
        return out

    def _group_by_adapter(self, out: SchedulerOutput) -> None:
        """Order the step's sequences by adapter (stably): each adapter's tokens are then
        consecutive rows, which the LoRA kernels take as slices. A step is a set of
        sequences, so its order changes nothing else."""
        order = sorted(range(len(self._scheduled)), key=lambda i: self._scheduled[i].lora_key)
        self._scheduled = [self._scheduled[i] for i in order]
        out.scheduled = [out.scheduled[i] for i in order]

    def _add_to_step(self, out: SchedulerOutput, seq: Sequence, num_new: int, copies: list[tuple[int, int]]) -> None:
        out.block_copies.extend(copies)
        out.scheduled.append(ScheduledSequence.of(seq, num_new))
        self._scheduled.append(seq)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        num_running_slots = sum(s.num_slots for s in self.running) + len(self.receiving)
        adapters = {s.lora_key for s in self.running + self.receiving if s.lora_key}
        while self.waiting:
            seq = self.waiting[0]
            if self.kv.num_blocks_for(max(seq.num_tokens, seq.max_num_tokens)) > self.kv.num_usable_blocks:
                self.waiting.pop(0)  # it would wait at the head forever, and everything behind it
                seq.status = SequenceStatus.FINISHED
                out.unfit.append((seq.request_id, seq.index))
                continue
            receiving = seq.kv_from_remote and seq.num_computed_tokens == 0  # computes nothing: no budget
            if budget <= 0 and not receiving:
                break
            if num_running_slots + seq.num_slots > self.config.max_num_seqs:
                break
            if seq.lora_key and seq.lora_key not in adapters:
                if len(adapters) >= self.max_loras:
                    break
                adapters.add(seq.lora_key)
            cached_block_ids = self.kv.find_cached_prefix(seq) if seq.use_prefix_cache else []
            num_cached_tokens = len(cached_block_ids) * self.kv.block_size
            if receiving:
                if not self._admit_receiving(out, seq, cached_block_ids):
                    break
                num_running_slots += 1
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens - num_cached_tokens, budget)
            copies = self.kv.allocate(seq, num_new, cached_block_ids)
            if copies is None:
                break
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = min(num_cached_tokens, seq.num_prompt_tokens)
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_running_slots += seq.num_slots
            self._add_to_step(out, seq, num_new, copies)
            budget -= num_new

    def _admit_receiving(self, out: SchedulerOutput, seq: Sequence, cached_block_ids: list[int]) -> bool:
        """Allocate the whole prompt (no compute, so no token budget) and order the pull of
        what the prefix cache does not hold. False when the pool cannot hold it now."""
        num_cached_tokens = len(cached_block_ids) * self.kv.block_size
        copies = self.kv.allocate(seq, seq.num_tokens - num_cached_tokens, cached_block_ids)
        if copies is None:
            return False
        assert not copies, "a fresh sequence's cached head is whole blocks: nothing to copy"
        seq.num_cached_tokens = num_cached_tokens
        self.waiting.pop(0)
        seq.status = SequenceStatus.RECEIVING
        self.receiving.append(seq)
        first = len(cached_block_ids)
        out.kv_loads.append(KvLoad(seq.request_id, first, tuple(seq.block_table[first:])))
        return True

    def finish_receiving(self, seq: Sequence) -> None:
        """Its pull ended well: the prompt's KV is in its blocks. It runs from the next
        schedule (decoding), and its full blocks are published like computed ones."""
        self.receiving.remove(seq)
        seq.num_computed_tokens = seq.num_tokens
        seq.kv_from_remote = False  # preempted later, it recomputes its prompt here
        self.kv.cache_full_blocks(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        if seq.recomputable:
            self.add(seq)
        else:
            seq.status = SequenceStatus.FINISHED
            self._lost.append((seq.request_id, seq.index))

    def update_from_output(self, out: SchedulerOutput) -> None:
        """The step ``out`` (the last ``schedule()``) ran: its tokens' KV is in the cache.
        Advance each sequence and publish its newly full blocks, parents first."""
        assert len(out.scheduled) == len(self._scheduled), "update_from_output of a step that was not scheduled last"
        for scheduled, seq in zip(out.scheduled, self._scheduled, strict=True):
            seq.num_computed_tokens += scheduled.num_new_tokens
            # Even a request that bypassed the cache publishes what it computed (K1).
            self.kv.cache_full_blocks(seq)
