"""Section E — KV events (E1–E6): ``Control.SubscribeKvEvents`` and ``GetKvEventSources``.

What a client can see on any server: while the suite generates a few requests with fresh
prompts, the batches a subscriber receives are numbered strictly increasing per rank (E1);
a snapshot lists the blocks cached by an earlier request and live batches follow it
without a gap (E2); a replay from a number still retained gives the same batches again and
one that is gone ends with exactly one terminal ``EngineError``, then status OK (E1, E5);
every stored block's parent is known to a view built from a snapshot (E3/E4), and a salted
copy of a prompt stores blocks of its own (E4); ``GetKvEventSources`` never advertises a
wildcard host, answers one source per requested rank or none, and refuses unknown or
repeated ranks (E6). Every check skips, saying why, on a server whose ``SubscribeKvEvents``
is UNIMPLEMENTED.

:class:`KvSubscriber` and :class:`KvView` are also used by refengine's own integration tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc

from refengine.conformance.enums import enum_name
from refengine.conformance.hosts import is_wildcard_host
from refengine.conformance.kv_subscriber import (  # noqa: F401
    _MISSING,
    EVENT_WAIT_S,
    SETTLE_S,
    HashKey,
    KvSubscriber,
    KvView,
    _block_size,
    _key,
    _need_text,
    fresh_prompt,
    generate,
    latest_number,
    live_batches,
    subscribe,
    terminal_error,
)
from refengine.conformance.registry import check, expect, not_claimed, skip
from refengine.conformance.target import Target
from refengine.protocol import oe


@check("E1", "sequence_number strictly increases per rank while requests run")
def sequence_numbers_increase(t: Target) -> str:
    """E1: a live subscriber's batches, caused by fresh requests, are numbered strictly increasing."""
    sub, _ = live_batches(t, "e1", wanted=3)
    try:
        batches = sub.batches
    finally:
        sub.close()
    last: dict[int, int] = {}
    for b in batches:
        previous = last.get(b.data_parallel_rank)
        expect(previous is None or b.sequence_number > previous,
               f"rank {b.data_parallel_rank}: batch {b.sequence_number} after {previous}; sequence numbers must "
               "strictly increase")
        last[b.data_parallel_rank] = b.sequence_number
    return f"{len(batches)} batches {[b.sequence_number for b in batches]}"


@check("E1", "start_sequence_number still retained: the same batches again")
def replay_retained(t: Target) -> str:
    """E1: replaying from the first batch a live subscriber got gives those batches, equal."""
    live, _ = live_batches(t, "e1r", wanted=2)
    try:
        seen = live.batches
    finally:
        live.close()
    start, end = seen[0].sequence_number, seen[-1].sequence_number
    replay = subscribe(t, start=start)
    try:
        replay.wait_sequence(end)
        got = [b for b in replay.batches if b.sequence_number <= end]
        expect(not replay.errors, f"replay from {start} (retained a moment ago) failed: {replay.describe()}")
    finally:
        replay.close()
    expect(got == seen,
           f"replay from {start} gave batches {[b.sequence_number for b in got]}, the live subscriber saw "
           f"{[b.sequence_number for b in seen]} (or their contents differ); a replay repeats the same batches")
    return f"batches {start}..{end} replayed identically"


@check("E1", "start_sequence_number no longer retained: one terminal EngineError, then OK")
def replay_expired(t: Target) -> str:
    """E1: replay from batch 1 once the server has published ``Options.replay_budget_batches``
    batches (the suite's requests, then fresh ones of its own, one at a time, until then); skips
    while batch 1 is still retained. So the outcome does not depend on how many checks ran
    before. A refusal by status (no event) is no silent replay: E1 holds; that the failure
    should be an error event is E5's."""
    live, _ = live_batches(t, "e1x", wanted=2)
    try:
        newest = _publish_up_to(t, live, t.options.replay_budget_batches)
    finally:
        live.close()
    if newest <= 1:
        skip(f"the newest batch is {newest}: nothing can have expired yet")
    sub = subscribe(t, start=1)
    try:
        sub.wait_responses(1)
        first = sub.responses[0] if sub.responses else None
        if first is not None and first.WhichOneof("event") == "batch":
            number = first.batch.sequence_number
            expect(number <= 1, f"replay from 1 began at batch {number} without an error: batches 1..{number - 1} "
                                "were skipped silently (expected a terminal EngineError)")
            skip(f"batch 1 is still retained (newest {newest}): the retention window covers this run "
                 "(--replay-budget-batches sets how many batches the check has published first)")
        if sub.wait_end(EVENT_WAIT_S) and sub.code != grpc.StatusCode.OK and not sub.responses:
            return (f"replay from 1 (newest {newest}) refused with status {sub.code.name}: not served silently (a "
                    "failure after acceptance being one error event, then OK, is E5's)")
        error = terminal_error(sub, "replay from expired sequence number 1")
    finally:
        sub.close()
    return f"replay from 1 (newest {newest}): {enum_name(oe.ErrorCode, error.code)} {error.message!r}, then OK"


def _publish_up_to(t: Target, live: KvSubscriber, budget: int) -> int:
    """Fresh requests, one at a time, until ``live`` has seen batch number ``budget`` (or a
    request caused no batch, or ``budget`` requests were sent); the newest number seen."""
    newest = max(b.sequence_number for b in live.batches)
    for n in range(budget):
        if newest >= budget:
            break
        seen = len(live.batches)
        generate(t, fresh_prompt(t, f"e1x{n}"))
        if not live.wait(lambda s, seen=seen: len(s.batches) > seen, 2.0):
            break
        newest = max(b.sequence_number for b in live.batches)
    return newest


# -- E2 ------------------------------------------------------------------------------------
@check("E2", "include_snapshot: first the cached blocks, then live batches without a gap")
def snapshot_then_live(t: Target) -> str:
    """E2: after a long prompt ran, a snapshot's first batch lists blocks (BlockStored only);
    the first live batch a new request causes is numbered right after it."""
    _need_text(t)
    generate(t, fresh_prompt(t, "e2", blocks=4))
    sub = subscribe(t, include_snapshot=True)
    try:
        expect(bool(sub.responses), f"include_snapshot sent nothing within {EVENT_WAIT_S:.0f} s: "
                                    f"{sub.describe()}")
        expect(sub.kinds()[0] == "batch", f"include_snapshot's first response is not a batch: {sub.describe()}")
        snap = sub.batches[0]
        kinds = {e.WhichOneof("event") for e in snap.events}
        expect(bool(snap.events), "the snapshot is empty right after a 4-block prompt ran; it lists the blocks "
                                  "currently cached")
        expect(kinds == {"block_stored"}, f"the snapshot holds {sorted(kinds)}; it lists cached blocks "
                                          "(BlockStored only)")
        view = KvView()
        view.apply(snap)
        expect(not view.problems, f"snapshot: {view.problems[:3]} (parents come before children)")
        generate(t, fresh_prompt(t, "e2live"))
        expect(sub.wait_responses(2), f"no live batch after the snapshot and a new request: {sub.describe()}")
        live = sub.batches[1]
    finally:
        sub.close()
    expect(live.sequence_number == snap.sequence_number + 1,
           f"snapshot numbered {snap.sequence_number}, first live batch {live.sequence_number}: a gap or a "
           "duplicate (the snapshot carries the number of the last batch it includes)")
    return f"snapshot {snap.sequence_number} with {len(view.blocks)} blocks, live from {live.sequence_number}"


# -- E3/E4 ---------------------------------------------------------------------------------
def _new_batches(sub: KvSubscriber, request: Callable[[], None]) -> list[Any]:
    """The batches that arrive after ``request`` (one Generate that stores fresh blocks, or none)."""
    before = len(sub.batches)
    request()
    sub.wait(lambda s: len(s.batches) > before, 2.0)
    time.sleep(SETTLE_S)  # the rest of its batches
    return sub.batches[before:]


@check("E4", "every BlockStored's parent is known; a salted copy of a prompt stores blocks of its own")
def stored_events_chain(t: Target) -> str:
    """E3/E4: a view built from a snapshot and the live batches never meets a child before
    its parent or a removal of an unknown block; with ``supports_cache_salt``, the same prompt
    under a new salt stores its blocks again (under other hashes: the salt is part of them).
    A child of a block the view never saw, after an empty snapshot, may be the snapshot's
    omission (E2's finding): then the chain cannot be judged (skip)."""
    _need_text(t)
    sub = subscribe(t, include_snapshot=True)
    salted = bool(t.caps.supports_cache_salt)
    try:
        expect(bool(sub.batches), f"include_snapshot sent no batch: {sub.describe()}")
        prompt = fresh_prompt(t, "e4")
        _new_batches(sub, lambda: generate(t, prompt))
        # a shared prefix: its new blocks chain onto cached ones
        _new_batches(sub, lambda: generate(t, prompt + " And then"))
        again = _new_batches(sub, lambda: generate(t, prompt, salt=t.new_id("salt"))) if salted else []
        batches = sub.batches
        expect(not sub.errors, f"the subscription failed: {sub.describe()}")
    finally:
        sub.close()
    view = KvView()
    for b in batches:  # in arrival order: how they are numbered is E1's
        view.apply(b)
    if view.problems and not batches[0].events:
        skip(f"{view.problems[0]}, after an empty snapshot (E2 fails for it): the chain cannot be followed")
    expect(not view.problems, "; ".join(view.problems[:3]))
    if not salted:
        return f"{len(batches)} batches chain; cache_salt not advertised"
    stored = sum(len(e.block_stored.block_hashes) for b in again for e in b.events
                 if e.WhichOneof("event") == "block_stored")
    expect(stored > 0, "the same prompt under a new cache_salt stored no block: its blocks hash as the unsalted "
                       "ones, so the salt is not in the block hash (E4, K2)")
    return f"{len(batches)} batches chain; a salted copy stored {stored} blocks of its own"


# -- E5 ------------------------------------------------------------------------------------
@check("E5", "a failure after acceptance (replay point not retained) is one final error event, then OK")
def failure_is_error_then_ok(t: Target) -> str:
    """E5: a replay from a number far beyond the newest batch cannot be served (not retained):
    exactly one EngineError, nothing after it, status OK."""
    _need_text(t)
    start = latest_number(t) + 1000
    sub = subscribe(t, start=start)
    try:
        if not sub.wait_responses(1, 3.0) and not sub.ended:
            skip(f"replay from {start} (beyond the newest batch) waits instead of failing: no failure to observe")
        error = terminal_error(sub, f"replay from {start}, beyond the newest batch")
    finally:
        sub.close()
    return f"{enum_name(oe.ErrorCode, error.code)} (retryable={error.retryable}) {error.message!r}, then OK"


# -- E6 ------------------------------------------------------------------------------------
def _sources(t: Target, ranks: list[int]) -> tuple[grpc.StatusCode, Any]:
    return t.unary_code("GetKvEventSources", oe.GetKvEventSourcesRequest(data_parallel_ranks=ranks))


def _ranks(t: Target) -> tuple[int, int]:
    """(first rank, number of ranks) as ServerInfo.parallelism reports them (0, 1 when absent)."""
    p = t.server_info.parallelism
    first = p.data_parallel_start_rank if p.HasField("data_parallel_start_rank") else 0
    size = p.data_parallel_size if p.HasField("data_parallel_size") and p.data_parallel_size > 0 else 1
    return first, size


def _source_problems(sources: Any) -> list[str]:
    problems = []
    for s in sources:
        host = s.endpoint_addr.host
        if is_wildcard_host(host):
            problems.append(f"source for rank {s.data_parallel_rank} advertises wildcard host {host!r}")
        if not 0 < s.endpoint_addr.port < 65536:
            problems.append(f"source for rank {s.data_parallel_rank} has port {s.endpoint_addr.port}")
    return problems


@check("E6", "GetKvEventSources: no wildcard host, one source per requested rank or none, bad ranks refused")
def kv_event_sources(t: Target) -> str:
    """E6: every endpoint is connectable (a concrete host, a port); asking for one rank gives
    that rank's source or none; an unknown rank and a rank named twice are INVALID_ARGUMENT."""
    code, every = _sources(t, [])
    if code == grpc.StatusCode.UNIMPLEMENTED:
        not_claimed("GetKvEventSources is UNIMPLEMENTED")
    expect(code == grpc.StatusCode.OK, f"GetKvEventSources() returned {code.name}")
    problems = _source_problems(every.sources)
    expect(not problems, "; ".join(problems))
    first, size = _ranks(t)
    code, one = _sources(t, [first])
    expect(code == grpc.StatusCode.OK, f"GetKvEventSources([{first}]) returned {code.name}")
    expect(len(one.sources) <= 1, f"GetKvEventSources([{first}]) returned {len(one.sources)} sources; one per rank")
    for s in one.sources:
        expect(not s.HasField("data_parallel_rank") or s.data_parallel_rank == first,
               f"asked for rank {first}, got a source for rank {s.data_parallel_rank}")
    expect(not _source_problems(one.sources), "; ".join(_source_problems(one.sources)))
    for what, ranks in (("an unknown rank", [first + size]), ("a rank named twice", [first, first])):
        code, _ = _sources(t, ranks)
        expect(code == grpc.StatusCode.INVALID_ARGUMENT,
               f"GetKvEventSources({ranks}) ({what}) returned {code.name}; expected INVALID_ARGUMENT")
    return f"{len(every.sources)} source(s); ranks [{first + size}] and [{first}, {first}] refused"
