"""Prefix hashes against an independent oracle (hashlib and struct): media keys per block, the
chained block hash, and hash_full_blocks extending a known prefix.

A mutation run over refengine/kv/prefix_hash.py (comparisons flipped, constants moved,
statements deleted) found these behaviours untested; each test pins one rule stated by the module.
"""

from __future__ import annotations

import hashlib
import struct

from refengine.kv.prefix_hash import block_extra_keys, hash_block, hash_full_blocks


def _oracle_hash(parent: bytes | None, tokens: list[int], keys: tuple[str, ...]) -> bytes:
    """SHA-256 of the parent hash (32 zero bytes for the first block), the tokens as
    little-endian uint32, then each key as its uint32 byte length and UTF-8 bytes."""
    d = hashlib.sha256(parent or bytes(32))
    d.update(b"".join(struct.pack("<I", t) for t in tokens))
    for key in keys:
        d.update(struct.pack("<I", len(key.encode())) + key.encode())
    return d.digest()


def test_media_keys_go_to_exactly_the_blocks_their_positions_touch() -> None:
    """A media item's key is added to exactly the blocks its half-open span [first, last)
    overlaps, [i*bs, (i+1)*bs) for block i; a key on a block it does not touch (or missing from
    one it does) gives a prefix hit on KV computed for other media. No other unit test hashes
    with media spans."""
    spans = ((4, 8, "img0"), (9, 11, "img1"), (11, 17, "img2"))
    bs = 4
    expected = {0: (), 1: ("media:img0",), 2: ("media:img1", "media:img2"), 3: ("media:img2",),
                4: ("media:img2",), 5: ()}
    for index, media in expected.items():
        assert block_extra_keys(index, bs, ("m",), spans) == ("m",) + media, index
    tokens = list(range(100, 124))
    hashes = hash_full_blocks(tokens, bs, ("m",), [], media_spans=spans)
    parent = None
    for i, got in enumerate(hashes):
        parent = _oracle_hash(parent, tokens[i * bs:(i + 1) * bs], ("m",) + expected[i])
        assert got == parent, i


def test_hash_full_blocks_extends_known_hashes_and_respects_num_blocks() -> None:
    """``hash_full_blocks`` extends the given list in place (and returns it), stops at
    ``num_blocks`` when given and otherwise at the last full block, and chains each new hash
    onto the last known one."""
    tokens = list(range(10))
    known: list[bytes] = []
    assert hash_full_blocks(tokens, 4, (), known, num_blocks=1) is known and len(known) == 1
    assert len(hash_full_blocks(tokens, 4, (), known)) == 2  # 10 tokens: 2 full blocks
    assert known[1] == _oracle_hash(known[0], tokens[4:8], ())
    assert hash_block(None, [1, 2], ("ab",)) == _oracle_hash(None, [1, 2], ("ab",))
