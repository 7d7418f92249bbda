"""Section E — KV events, E1 and E2: ``Control.SubscribeKvEvents``'s numbering, replay and snapshot.

What a client can see on any server: while the suite generates a few requests with fresh
prompts, the batches a subscriber receives are numbered strictly increasing per rank (E1); a
replay from a number still retained gives the same batches again, and one that is gone is not
served silently (E1; that it fails as one terminal ``EngineError``, then OK, is E5's,
``checks_kv_sources``); a snapshot lists exactly the blocks a live subscriber knows to be
cached, and live batches follow it without a gap (E2). Every check skips, saying why, on a
server whose ``SubscribeKvEvents`` is UNIMPLEMENTED. E3 is ``checks_kv_block_events``, E4
``checks_kv_hash``, E5 and E6 ``checks_kv_sources``.
"""

from __future__ import annotations

from typing import Any

import grpc

from refengine.conformance.enums import enum_name
from refengine.conformance.kv_subscriber import (
    KvSubscriber,
    KvView,
    _key,
    _need_text,
    expired_replay,
    fresh_prompt,
    generate,
    latest_number,
    live_batches,
    subscribe,
    terminal_error,
)
from refengine.conformance.registry import check, expect, skip
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
    """E1: a replay from the first batch a live subscriber got gives the batches that subscriber
    got, equal, up to its newest once it held two (a second fresh request, when the first
    caused one). The replay is opened as soon as that first batch arrived, so the suite has
    published nothing since but that request's batches (before, the check replayed after more
    requests, and a conforming server retaining fewer batches, or a lagging stream that made the
    suite send more, failed E1). It then waits for what it compares, not for a time window.

    RULES set no retention minimum: a request can cause more batches than a server retains (a
    toy retaining one batch, publishing 16 blocks a batch, refused the replay of a 49-block
    prompt's first batch, and E1 failed it). A refused replay (an EngineError first, or a status
    and no batch) says the batch is gone, so the check replays from the newest batch instead,
    once the live subscriber has it; when that is refused too, it skips."""
    live, _ = live_batches(t, "e1r", wanted=1)
    try:
        first = start = live.batches[0].sequence_number
        got, seen = _replay(t, live, start)
        if got is None:  # the request's first batch is no longer retained: its newest may be
            live.wait_sequence(latest_number(t))
            start = max(b.sequence_number for b in live.batches)
            got, seen = _replay(t, live, start) if start != first else (None, [])
            if got is None:
                which = f") and one from the newest, {start}, were" if start != first else ", and the newest) was"
                skip(f"a replay from batch {first} (the first a fresh request caused, once it arrived live{which} "
                     "refused: the server retains fewer batches than one request causes, or none (RULES set no "
                     "retention minimum)")
    finally:
        live.close()
    end = seen[-1].sequence_number
    expect(got == seen,
           f"replay from {start} gave batches {[b.sequence_number for b in got]}, the live subscriber saw "
           f"{[b.sequence_number for b in seen]} (or their contents differ); a replay repeats the same batches")
    gone = "" if first == start else (f" (batch {first}, the request's first, was refused as no longer retained; "
                                      "RULES set no retention minimum)")
    return f"batches {start}..{end} replayed identically{gone}"


def _replay(t: Target, live: KvSubscriber, start: int) -> tuple[list[Any] | None, list[Any]]:
    """Replay from ``start``: the batches it gave up to the newest ``live`` saw from ``start``
    on once it held two (a fresh request when it did not), and those ``live`` batches; None for
    the replay when it was refused (an EngineError first, or a status and no batch)."""
    replay = subscribe(t, start=start)
    try:
        if replay.kinds()[:1] == ["error"] or (replay.ended and replay.code != grpc.StatusCode.OK
                                               and not replay.batches):
            return None, []
        if sum(b.sequence_number >= start for b in live.batches) < 2:
            generate(t, fresh_prompt(t, "e1r"))
            live.wait(lambda s: sum(b.sequence_number >= start for b in s.batches) >= 2)
        seen = [b for b in live.batches if b.sequence_number >= start]
        end = seen[-1].sequence_number
        replay.wait_sequence(end)
        expect(not replay.errors, f"replay from {start}, opened once batch {start} arrived live, failed: "
                                  f"{replay.describe()}")
        return [b for b in replay.batches if b.sequence_number <= end], seen
    finally:
        replay.close()


@check("E1", "start_sequence_number no longer retained: one terminal EngineError, then OK")
def replay_expired(t: Target) -> str:
    """E1: replay from batch 1 once the server has published ``Options.replay_budget_batches``
    batches (the suite's requests, then fresh ones of its own, one at a time, until then); skips
    while batch 1 is still retained. So the outcome does not depend on how many checks ran
    before. A refusal by status (no event) is no silent replay: E1 holds; that the failure
    should be an error event is E5's."""
    sub, newest = expired_replay(t, "e1x")
    try:
        sub.wait_responses(1)
        first = sub.responses[0] if sub.responses else None
        if first is not None and first.WhichOneof("event") == "batch":
            number = first.batch.sequence_number
            expect(number <= 1, f"replay from 1 began at batch {number} without an error: batches 1..{number - 1} "
                                "were skipped silently (expected a terminal EngineError)")
            skip(f"batch 1 is still retained (newest {newest}): the retention window covers this run "
                 "(--replay-budget-batches sets how many batches the check has published first)")
        if sub.wait_end() and sub.code != grpc.StatusCode.OK and not sub.responses:
            return (f"replay from 1 (newest {newest}) refused with status {sub.code.name}: not served silently (a "
                    "failure after acceptance being one error event, then OK, is E5's)")
        error = terminal_error(sub, "replay from expired sequence number 1")
    finally:
        sub.close()
    return f"replay from 1 (newest {newest}): {enum_name(oe.ErrorCode, error.code)} {error.message!r}, then OK"


# -- E2 ------------------------------------------------------------------------------------
@check("E2", "include_snapshot: first the cached blocks, then live batches without a gap")
def snapshot_then_live(t: Target) -> str:
    """E2: a live subscriber (the watcher) sees a 4-block prompt's blocks stored; a snapshot
    taken after it is one batch of BlockStored events, parents first, listing every block the
    watcher knows to be cached up to the snapshot's number and none it saw removed; the first
    live batch a new request causes is numbered right after the snapshot."""
    _need_text(t)
    watcher = subscribe(t)
    try:
        generate(t, fresh_prompt(t, "e2", blocks=4))
        watcher.wait(lambda s: bool(s.batches))
        sub = subscribe(t, include_snapshot=True)
        try:
            snap, view = _snapshot(sub)
            expect(watcher.wait_sequence(snap.sequence_number),
                   f"the snapshot includes batches up to {snap.sequence_number}; a live subscriber opened before "
                   f"it has not received that batch within {watcher.event_wait_s:.0f} s ({watcher.describe()})")
            _expect_same_blocks(watcher.batches, snap.sequence_number, set(view.blocks))
            generate(t, fresh_prompt(t, "e2live"))
            expect(sub.wait_responses(2), f"no live batch after the snapshot and a new request: {sub.describe()}")
            live = sub.batches[1]
        finally:
            sub.close()
    finally:
        watcher.close()
    expect(live.sequence_number == snap.sequence_number + 1,
           f"snapshot numbered {snap.sequence_number}, first live batch {live.sequence_number}: a gap or a "
           "duplicate (the snapshot carries the number of the last batch it includes)")
    return f"snapshot {snap.sequence_number} with {len(view.blocks)} blocks, live from {live.sequence_number}"


def _snapshot(sub: Any) -> tuple[Any, KvView]:
    """The snapshot batch (the first response): BlockStored only, not empty, parents first."""
    expect(bool(sub.responses), f"include_snapshot sent nothing within {sub.event_wait_s:.0f} s: {sub.describe()}")
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
    return snap, view


def _expect_same_blocks(batches: list[Any], until: int, listed: set[Any]) -> None:
    """E2: what the live ``batches`` numbered up to ``until`` say is cached is in the snapshot
    (``listed``), and what they say was removed (or cleared) and not stored again is not."""
    cached: set[Any] = set()
    removed: set[Any] = set()
    cleared = False
    for batch in batches:
        if batch.sequence_number > until:
            break
        for event in batch.events:
            kind = event.WhichOneof("event")
            if kind == "block_stored":
                keys = {_key(h) for h in event.block_stored.block_hashes}
                cached |= keys
                removed -= keys
            elif kind == "block_removed":
                keys = {_key(h) for h in event.block_removed.block_hashes}
                cached -= keys
                removed |= keys
            elif kind == "all_blocks_cleared":
                cached, removed, cleared = set(), set(), True
    missing = cached - listed
    stale = (listed - cached) if cleared else (removed & listed)
    expect(not missing, f"the snapshot (up to batch {until}) leaves out {len(missing)} of the {len(cached)} blocks "
                        "a live subscriber saw stored and not removed by then; it lists every block cached")
    expect(not stale, f"the snapshot (up to batch {until}) lists {len(stale)} blocks a live subscriber saw removed "
                      "by then; it lists only the blocks cached")
