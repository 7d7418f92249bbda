"""A NIXL source as a session's ``transfer`` attributes describe it (``NixlKvTransfer.source_attributes``
made them; a client forwards them, so every key is checked): parsing, and the checks against this
engine's KV cache and a pull's order.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from refengine.kv.transfer.attributes import json_int
from refengine.kv.transfer.base import BlockStore, KvRegion, PullOrder, TransferFailure


@dataclass(frozen=True)
class NixlSource:
    """A session's source as its attributes describe it (validated)."""

    agent_name: str
    metadata: bytes
    regions: tuple[KvRegion, ...]
    block_ids: tuple[int, ...]


def fail(message: str, retryable: bool = False, dest_may_change: bool = False) -> TransferFailure:
    return TransferFailure("failed", message, retryable=retryable, dest_may_change=dest_may_change)


def _is_int(value: Any) -> bool:
    return json_int(value) is not None


def _parse_region(value: Any) -> KvRegion:
    """``[address as a decimal string (K9), num_blocks, block_nbytes]``."""
    if not (isinstance(value, list) and len(value) == 3 and isinstance(value[0], str) and value[0].isascii()
            and value[0].isdigit() and _is_int(value[1]) and _is_int(value[2])):
        raise fail(f"nixl_regions entry {value!r} is not [address string, num_blocks, block_nbytes]")
    if int(value[0]) >= 2**64 or value[1] < 1 or value[2] < 1:
        raise fail(f"nixl_regions entry {value!r} is out of range")
    return KvRegion(int(value[0]), int(value[1]), int(value[2]))


def source_identity(agent_name: str, metadata: bytes, regions: Sequence[KvRegion]) -> str:
    """A digest of what a one-sided READ reads from: the agent (its name and metadata, which
    hold its address and the remote keys) and its registered regions."""
    digest = hashlib.sha256(f"{agent_name}\0{len(metadata)}\0".encode() + metadata)
    digest.update(";".join(f"{r.address}:{r.num_blocks}:{r.block_nbytes}" for r in regions).encode())
    return digest.hexdigest()


def parse_source(attributes: Any) -> NixlSource:
    """The ``transfer`` attributes that ``source_attributes`` made, checked key by key."""
    if not isinstance(attributes, Mapping):
        raise fail("the session has no NIXL transfer attributes")
    name, metadata = attributes.get("nixl_agent_name"), attributes.get("nixl_agent_metadata")
    regions, block_ids = attributes.get("nixl_regions"), attributes.get("nixl_block_ids")
    if not (isinstance(name, str) and name and isinstance(metadata, str)
            and isinstance(regions, list) and isinstance(block_ids, list)):
        raise fail("NIXL transfer attributes need nixl_agent_name, nixl_agent_metadata (strings), "
                    "nixl_regions and nixl_block_ids (lists)")
    if not all(_is_int(b) and b >= 0 for b in block_ids):
        raise fail("nixl_block_ids must be non-negative integers")
    try:
        raw = base64.b64decode(metadata, validate=True)
    except (binascii.Error, ValueError) as error:
        raise fail(f"nixl_agent_metadata is not base64: {error}") from None
    return NixlSource(name, raw, tuple(_parse_region(r) for r in regions), tuple(int(b) for b in block_ids))


def check_regions(source: NixlSource, store: BlockStore) -> None:
    """The source's regions match ours: as many, with blocks of the same bytes."""
    if len(source.regions) != len(store.regions):
        raise fail(f"the source has {len(source.regions)} KV regions, this engine {len(store.regions)}")
    for index, (theirs, mine) in enumerate(zip(source.regions, store.regions, strict=True)):
        if theirs.block_nbytes != mine.block_nbytes:
            raise fail(f"region {index}: source blocks of {theirs.block_nbytes} bytes, here {mine.block_nbytes}")


def check_fit(source: NixlSource, store: BlockStore, order: PullOrder) -> None:
    """The source's regions match ours byte for byte, and the order stays inside both caches."""
    check_regions(source, store)
    first, count = order.first_block_index, len(order.dest_block_ids)
    if first < 0 or first + count > len(source.block_ids):
        raise fail(f"blocks {first}..{first + count - 1} requested, the session has {len(source.block_ids)}")
    check_block_ids(source)
    dest = order.dest_block_ids
    if dest and not (min(dest) >= 0 and max(dest) < min(r.num_blocks for r in store.regions)):
        raise fail("destination block ids fall outside this engine's KV cache")


def check_block_ids(source: NixlSource) -> None:
    """The source's block ids fall inside its regions (max/min once, not per block and region: at
    2,048 tokens, 128 blocks and 60 regions, that cost 0.44 ms a pull)."""
    if source.block_ids and max(source.block_ids) >= min((r.num_blocks for r in source.regions), default=0):
        raise fail("nixl_block_ids fall outside the source's regions")


def source_problem(transfer: Any, num_blocks: int, store: BlockStore | None) -> str:
    """What makes a decode request's NIXL attributes unusable before acceptance (K5), "" when
    nothing does: they parse, match this engine's regions (``store``, when bound), carry agent
    metadata and one block id per block of the session, each inside the source's regions."""
    try:
        source = parse_source(transfer)
        if store is not None:
            check_regions(source, store)
        if not source.metadata:
            raise fail("nixl_agent_metadata is empty")
        if len(source.block_ids) != num_blocks:
            raise fail(f"{len(source.block_ids)} nixl_block_ids for a session of {num_blocks} blocks")
        check_block_ids(source)
    except TransferFailure as error:
        return str(error)
    return ""


def runs(pairs: Sequence[tuple[int, int]]) -> Iterator[tuple[int, int, int]]:
    """(dest, source, length) of each maximal run of (dest, source) block ids both going up by one."""
    start = 0
    for i in range(1, len(pairs) + 1):
        if i == len(pairs) or pairs[i] != (pairs[i - 1][0] + 1, pairs[i - 1][1] + 1):
            yield pairs[start][0], pairs[start][1], i - start
            start = i


def descriptor_ranges(order: PullOrder, source: NixlSource, store: BlockStore) -> tuple[list, list]:
    """Local and remote (address, bytes, device) ranges, pairwise equal in length: one per run of
    consecutive blocks and region."""
    first = order.first_block_index
    pairs = [(d, source.block_ids[first + i]) for i, d in enumerate(order.dest_block_ids)]
    local, remote = [], []
    for dest, src, length in runs(pairs):
        for mine, theirs in zip(store.regions, source.regions, strict=True):
            size = length * mine.block_nbytes
            local.append((mine.address + dest * mine.block_nbytes, size, 0))
            remote.append((theirs.address + src * theirs.block_nbytes, size, 0))
    return local, remote
