"""Waiting for what a request announces, for the E3/E4 checks: until the condition judged holds,
not for a time window.

A KV event stream may run behind its engine (RULES set no bound): a request's batches can
arrive after its response, and a step's later batches after its first. A check that judged the
batches seen a fixed time after the first one misjudged such a stream (found in CI: a toy
delivering 16-block batches 0.5 s late failed E3 under load). So the checks poll a subscriber's
view until what they judge has arrived: the chain of blocks a request stored covers what a repeat
of it reuses from cache (E3: a block a request can hit was announced), or a violation is already
visible (the caller's ``seen_violation``), or the event wait (``Options.event_wait_s``)
passed. Then they judge every event seen, so a violation still fails, within that bound. Where
what is judged has no such condition (E3's eviction check: every batch a prompt caused, every
removal prompts caused), ``caught_up`` waits until the stream reached the newest batch the server
had published, as a snapshot numbers it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from refengine.conformance.kv_subscriber import (
    HashKey,
    KvSubscriber,
    KvView,
    _block_size,
    _key,
    latest_number,
)
from refengine.conformance.target import Target


class Tracker:
    """A snapshot subscriber's view, applied batch by batch, that records removals and the
    largest number of blocks it ever held."""

    def __init__(self, sub: KvSubscriber) -> None:
        self.sub, self.view, self.applied = sub, KvView(), 0
        self.removed: set[HashKey] = set()
        self.most_held = 0

    def catch_up(self) -> None:
        for batch in self.sub.batches[self.applied:]:
            for event in batch.events:
                if event.WhichOneof("event") == "block_removed":
                    self.removed.update(_key(h) for h in event.block_removed.block_hashes)
            self.view.apply(batch)
            self.most_held = max(self.most_held, len(self.view.blocks))
            self.applied += 1

    def stored_since(self, before: int) -> list[Any]:
        """The BlockStored events of the batches from number ``before`` (an index into ``sub.batches``) on."""
        return [e.block_stored for b in self.sub.batches[before:] for e in b.events
                if e.WhichOneof("event") == "block_stored"]

    def evicted_any(self, blocks: list[HashKey]) -> bool:
        """Whether one of ``blocks`` was removed (any block at all, when ``blocks`` is empty)."""
        return bool(self.removed.intersection(blocks)) if blocks else bool(self.removed)

    def unknown_removals(self) -> list[str]:
        """Removals of blocks the view never held; not judged after an empty snapshot (E2's finding)."""
        batches = self.sub.batches
        if not batches or not batches[0].events:
            return []
        return [p for p in self.view.problems if "BlockRemoved" in p]


def caught_up(t: Target, tracker: Tracker) -> None:
    """Wait until ``tracker`` has seen every batch the server had published when this was
    called: up to the number a new snapshot carries (E2: the last batch it includes), at most
    the event wait; then apply the view as far as it got (what arrived is judged either way)."""
    tracker.sub.wait_sequence(latest_number(t))
    tracker.catch_up()


def depth(view: KvView, block: HashKey) -> int | None:
    """How many blocks the chain ending at ``block`` holds; None when a parent is unknown to the view."""
    n, at = 0, block
    while at is not None:
        if at not in view.blocks:
            return None
        n, at = n + 1, view.blocks[at]
    return n


def chain_depths(view: KvView, stored: list[Any]) -> list[int | None]:
    """The depth of every block ``stored`` names (None: its chain reaches a parent the view never saw)."""
    return [depth(view, _key(h)) for e in stored for h in e.block_hashes]


def announced(t: Target, tracker: Tracker, send: Callable[[], Any],
              seen_violation: Callable[[list[Any]], bool]) -> tuple[Any, int, list[Any]]:
    """Send a request that stores fresh blocks (``send`` returns its Usage or None), once its
    first batch arrived send it again, and wait until the BlockStored events since the first
    send end a chain of at least the blocks the repeat reused from cache, a chain reaches a
    parent the view never saw, or ``seen_violation(those events)`` holds; at most the event wait
    each. Returns the first Usage, the tokens the repeat reused and every BlockStored since the
    first send (the repeat's too: a late stream cannot tell them apart, and the repeat
    computes the same KV)."""
    block_size, before = _block_size(t), len(tracker.sub.batches)
    usage = send()
    tracker.sub.wait(lambda s: len(s.batches) > before)  # committed, so the repeat can hit
    again = send()
    cached = again.cached_prompt_tokens if again is not None and again.HasField("cached_prompt_tokens") else 0

    def judgeable(_: KvSubscriber) -> bool:  # invariant: the same inequality the checks judge with
        tracker.catch_up()
        stored = tracker.stored_since(before)
        depths = chain_depths(tracker.view, stored)
        return (None in depths or max(depths, default=0) * block_size >= cached) or seen_violation(stored)

    tracker.sub.wait(judgeable)
    tracker.catch_up()
    return usage, cached, tracker.stored_since(before)
