"""KV events: what the prefix cache published or forgot, in the order it happened.

The block pool appends events to a queue (only when built with
``record_events=True``) and the engine core drains it once per step with
``BlockPool.take_events()``. A subscriber (a KV-aware router) replays the stream
into its view of the published blocks, ``{block_hash: parent_hash}``:

- ``BlockStored``: add ``block_hash``. Its parent is always already in the view
  (or ``None`` for a first block): the pool never publishes a child before its parent.
- ``BlockRemoved``: remove ``block_hash`` (a cached block was evicted for reuse).
- ``AllBlocksCleared``: empty the whole view (``reset_prefix_cache``).

After replaying every event taken so far, the view's keys equal the pool's
published hashes (``BlockPool.hash_to_block``). Removals are not guaranteed
child-first: a block whose parent hash was published by a concurrent duplicate
may outlive that parent, so a subscriber must tolerate removing an inner node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from refengine.types.requests import LoraAdapterSpec


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A full block was published under ``block_hash`` (chained from ``parent_hash``)."""

    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    extra_keys: tuple[str, ...]
    lora: LoraAdapterSpec | None = None  # the adapter its KV was computed under (E4)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The block published under ``block_hash`` was evicted; the hash is no longer a hit."""

    block_hash: bytes


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every published hash is forgotten (the prefix cache was reset)."""


KvEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KvEventBatch:
    """The KV events of one engine step (or a snapshot), numbered per data-parallel rank.

    Live batches are numbered 1, 2, 3, … without gaps. A snapshot batch (the blocks cached
    when a subscription started, as ``BlockStored`` events in publication order, parents
    first) carries the number of the last live batch whose effects it includes (0 before
    any), so the live batches that follow it start at the next number: no gap, no duplicate.
    """

    sequence_number: int
    timestamp_unix_nanos: int
    data_parallel_rank: int
    events: tuple[KvEvent, ...]
    snapshot: bool = False
