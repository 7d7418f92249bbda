"""Small drivers for the KV manager and the scheduler, shared by the edge-case tests: a minimal
``KvSequence``, one compute step of it, a scheduler with a step that pretends the model ran, and a
subscriber's replay of KV events."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from refengine.config import SchedulerConfig
from refengine.kv.block_pool import BlockPool
from refengine.kv.kv_manager import KvCacheManager
from refengine.scheduler.scheduler import Scheduler
from refengine.scheduler.sequence import Sequence
from refengine.types import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent


@dataclass(eq=False)
class Seq:
    """A minimal KvSequence (the kv package does not depend on the scheduler's Sequence)."""

    token_ids: list[int]
    extra_keys: tuple[str, ...] = ()
    lora: None = None
    media_spans: tuple = ()
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def compute(kv: KvCacheManager, seq: Seq, num_tokens: int, hits: list[int] | None = None) -> bool:
    """Compute the next ``num_tokens`` of ``seq`` (one scheduler step for it) and publish its
    full blocks; False when the pool has no room."""
    if kv.allocate(seq, num_tokens, hits) is None:
        return False
    seq.num_computed_tokens += num_tokens
    kv.cache_full_blocks(seq)
    return True


def make_sched(num_blocks: int = 64, budget: int = 32, max_seqs: int = 8, block_size: int = 4,
               max_loras: int = 0, caching: bool = True) -> Scheduler:
    kv = KvCacheManager(BlockPool(num_blocks, enable_caching=caching), block_size)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs), kv, max_loras)


def sseq(rid: str, n: int, priority: int = 0, **kw: Any) -> Sequence:
    """A sequence whose prompt is the tokens ``1..n``."""
    return Sequence(rid, 0, list(range(1, n + 1)), n, priority=priority, **kw)


def step(s: Scheduler) -> dict[str, int]:
    """Schedule, pretend the model ran, append a token to the sequences that sampled; returns the
    tokens scheduled per request. The sampled sequences are paired with the step's items by
    position in the scheduler's own list, so the two orders must agree."""
    out = s.schedule()
    sampled = [q for q, item in zip(s._scheduled, out.scheduled, strict=False) if item.samples]
    s.update_from_output(out)
    for q in sampled:
        q.token_ids.append(7)
    return {item.request_id: item.num_new_tokens for item in out.scheduled}


def replay(view: dict[bytes, bytes | None], events: list[KvEvent]) -> None:
    """Apply ``events`` to ``view`` as a subscriber does (RULES E-rules): a child is never
    stored before its parent, a block is never stored twice, only held blocks are removed."""
    for event in events:
        if isinstance(event, BlockStored):
            assert event.parent_hash is None or event.parent_hash in view, "a child before its parent"
            assert event.block_hash not in view, "stored twice"
            view[event.block_hash] = event.parent_hash
        elif isinstance(event, BlockRemoved):
            assert event.block_hash in view, "removal of a block the view does not hold"
            del view[event.block_hash]
        elif isinstance(event, AllBlocksCleared):
            view.clear()
