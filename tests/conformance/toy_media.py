"""The toy engine's images (D9, G19, E4): on with ``Faults.images`` (supports_multimodal = true).

A token-id prompt holds PLACEHOLDER once per image; each image is an inline PNG (``raw_bytes``;
a URL or data URI is refused before acceptance, as D9 allows), read as IMAGE_POSITIONS
positions of that token, as a vision model's embeddings take a run of positions. Items that do
not match the placeholders, and bytes that are not a PNG, are refused before acceptance (G19;
unless ``Faults.unplaced_images_dropped`` or ``image_bytes_unchecked``).
An image moves the model's preferred character by a shift taken from its bytes, so two images
give different outputs (D9), unless ``Faults.images_ignored``; and, as refengine adds
``media:<identity>`` to the keys of the blocks holding an image's positions (refengine/kv/keys.py),
the toy adds the image's digest to the key of those blocks, in the prefix cache and in the KV
events' block hashes (E4), unless ``Faults.media_not_in_hash``.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from typing import Any

from refengine.kv.prefix_hash import MediaSpan
from refengine.protocol import oe
from tests.conformance.toy_faults import Faults
from tests.conformance.toy_requests import require

#: An ASCII control character: no greedy output of the toy and no prompt of the suite holds it,
#: so the suite's image prompts (known token ids around it) are the only ones that do.
PLACEHOLDER = 26
#: The positions one image takes. E4 puts an image after one block of text and two blocks after
#: it: with 4-token blocks, 64 positions make that prompt store 19 blocks, more than one of the
#: staggered stream's 16-block batches (KvFaults.staggered), whose later batch comes late.
IMAGE_POSITIONS = 64
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def identity(data: bytes) -> str:
    """An image's identity in block keys, as refengine names an item without a uuid."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _decodable(data: bytes) -> bool:
    """What the toy reads of an image: the PNG signature, then an IHDR chunk whose CRC matches."""
    if len(data) < 33 or not data.startswith(PNG_SIGNATURE):
        return False
    length, kind = struct.unpack(">I4s", data[8:16])
    (crc,) = struct.unpack(">I", data[29:33])
    return kind == b"IHDR" and length == 13 and crc == zlib.crc32(data[12:29])


def _images(req: Any, prompt: list[int], faults: Faults) -> list[bytes]:
    """G19: one inline PNG per placeholder, in order; anything else refused before acceptance."""
    items = list(req.media)
    require(all(m.modality == oe.MODALITY_IMAGE and m.WhichOneof("source") == "raw_bytes" for m in items),
            "toy: only images as raw_bytes are supported")
    placeholders = prompt.count(PLACEHOLDER)
    if faults.unplaced_images_dropped:  # a placeholder past the items stays a token (``expand``)
        items = items[:placeholders]
    else:
        require(placeholders == len(items), f"toy: {placeholders} image placeholders, {len(items)} media items")
    require(faults.image_bytes_unchecked or all(_decodable(m.raw_bytes) for m in items),
            "toy: a media item is not a PNG image")
    return [m.raw_bytes for m in items]


def expand(prompt: list[int], images: list[bytes]) -> tuple[list[int], list[MediaSpan]]:
    """The prompt with each placeholder (that has an image) as IMAGE_POSITIONS positions, and
    each image's (first position, end, identity)."""
    positions: list[int] = []
    spans: list[MediaSpan] = []
    pending = iter(images)
    for token in prompt:
        image = next(pending, None) if token == PLACEHOLDER else None
        if image is None:
            positions.append(token)
            continue
        spans.append((len(positions), len(positions) + IMAGE_POSITIONS, identity(image)))
        positions += [PLACEHOLDER] * IMAGE_POSITIONS
    return positions, spans


def requested(req: Any, prompt: list[int]) -> tuple[list[int], list[MediaSpan]]:
    """``expand`` for a request as sent, not validated (the KV events' view: the toy stores a
    prompt's blocks before the engine validates it)."""
    return expand(prompt, [m.raw_bytes for m in req.media])


def place(req: Any, prompt: list[int], faults: Faults) -> tuple[list[int], list[MediaSpan], int]:
    """The prompt the toy runs, its images' spans and their shift of the preferred character;
    the prompt unchanged without ``Faults.images`` or images."""
    if not faults.images or (not req.media and PLACEHOLDER not in prompt):
        return prompt, [], 0
    images = _images(req, prompt, faults)
    positions, spans = expand(prompt, images)
    if faults.images_ignored:  # the spans still key the blocks: only the output ignores the images
        return positions, spans, 0
    return positions, spans, sum(1 + hashlib.sha256(data).digest()[0] % 7 for data in images)
