"""Observing the engine core: load figures (``LoadInfo``, H4), usage, the idle check."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from refengine.engine.request import OutputStatus, Request
from refengine.kv.block_pool import BlockPool
from refengine.kv.kv_manager import KvCacheManager
from refengine.scheduler.scheduler import ScheduledSequence, Scheduler
from refengine.scheduler.sequence import SequenceStatus
from refengine.types import EngineStats, Usage


def batch_sizes(scheduled: Iterable[ScheduledSequence], requests: Mapping[str, Request]) -> tuple[int, int]:
    """(prefill, decode) requests of a step, as ``LoadInfo`` counts them ("requests in the last
    step"): a request computing prompt tokens, or several tokens at once (a recompute after
    preemption), prefills, whatever its chunk's size; its outputs count once."""
    prefill, decode = set(), set()
    for item in scheduled:
        prompt = len(requests[item.request_id].prompt_token_ids)
        (prefill if item.start < prompt or item.num_new_tokens > 1 else decode).add(item.request_id)
    return len(prefill), len(decode - prefill)


def engine_stats(requests: Iterable[Request], pool: BlockPool, last_batch: tuple[int, int]) -> EngineStats:
    """``last_batch``: (prefill, decode) requests of the last step (:func:`batch_sizes`), 0 once
    nothing runs. A request counts as running once any of its sequences runs; a decode request
    still receiving its KV waits."""
    num_requests = num_running = running_tokens = waiting_tokens = 0
    for request in requests:
        num_requests += 1
        if any(o.seq.status is SequenceStatus.RUNNING for o in request.outputs):
            num_running += 1
            running_tokens += sum(o.seq.num_tokens for o in request.outputs if o.status is OutputStatus.ACTIVE)
        else:
            waiting_tokens += len(request.prompt_token_ids)
    return EngineStats(
        running_requests=num_running,
        waiting_requests=num_requests - num_running,
        used_kv_blocks=pool.num_used,
        total_kv_blocks=pool.num_blocks,
        cached_kv_blocks=pool.num_cached,
        running_tokens=running_tokens,
        waiting_tokens=waiting_tokens,
        prefill_batch_size=last_batch[0] if num_running else 0,
        decode_batch_size=last_batch[1] if num_running else 0,
    )


def request_usage(request: Request) -> Usage:
    return Usage(
        prompt_tokens=len(request.prompt_token_ids),
        completion_tokens=sum(o.num_emitted_tokens for o in request.outputs),
        cached_prompt_tokens=request.num_cached_prompt_tokens,
    )


def check_idle(requests: Mapping[str, Request], scheduler: Scheduler, kv: KvCacheManager) -> None:
    """With no request in the core, every KV block is free or cached, or held by a named
    owner (a KV session, a cancelled pull), and each ref count matches its owners."""
    assert not requests and not scheduler.running and not scheduler.waiting and not scheduler.receiving
    kv.check_integrity()
    held = len({block for owner in kv.owners for block in kv.held_block_ids(owner)})  # owners may share
    assert kv.pool.num_used == held, f"{kv.pool.num_used} KV blocks in use with no request to own them"
