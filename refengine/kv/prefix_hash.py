"""Chained block hashes for the prefix cache.

A full block's hash covers its parent's hash, its token ids and every extra key
that changes the KV it holds (model fingerprint, LoRA, cache salt, media
hashes). So equal hashes mean equal KV, and a hit on block i implies hits on
blocks 0..i-1. sha256 over a fixed encoding keeps hashes stable across
processes, which KV events and disaggregation rely on.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple[str, ...]) -> bytes:
    digest = hashlib.sha256()
    digest.update(parent_hash or b"\x00" * 32)
    digest.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    for key in extra_keys:
        encoded = key.encode()
        digest.update(struct.pack("<I", len(encoded)))
        digest.update(encoded)
    return digest.digest()


MediaSpan = tuple[int, int, str]  # (first position, end position, identity) of one media item's run


def block_extra_keys(index: int, block_size: int, extra_keys: tuple[str, ...],
                     media_spans: Sequence[MediaSpan] = ()) -> tuple[str, ...]:
    """Block ``index``'s extra keys: the sequence's, then ``"media:<identity>"`` for each media
    item with a position in the block (blocks after it differ through the parent chain)."""
    start, end = index * block_size, (index + 1) * block_size
    media = tuple(f"media:{identity}" for first, last, identity in media_spans if first < end and last > start)
    return extra_keys + media


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[str, ...],
    known_hashes: list[bytes],
    num_blocks: int | None = None,
    media_spans: Sequence[MediaSpan] = (),
) -> list[bytes]:
    """Extend ``known_hashes`` (hashes of the first blocks) to every full block of
    ``token_ids``, or to the first ``num_blocks`` only. Returns the same list, extended
    in place; only the missing hashes are computed, so callers keep it per sequence."""
    num_full = len(token_ids) // block_size
    if num_blocks is not None:
        num_full = min(num_full, num_blocks)
    for i in range(len(known_hashes), num_full):
        parent = known_hashes[i - 1] if i else None
        block_tokens = token_ids[i * block_size : (i + 1) * block_size]
        known_hashes.append(hash_block(parent, block_tokens, block_extra_keys(i, block_size, extra_keys, media_spans)))
    return known_hashes
