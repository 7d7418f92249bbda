"""Embedding handles on the consumer side: what a request's handles must satisfy (ENC10–ENC12).

A consumer (an aggregated, prefill or decode engine with a vision path) takes a handle only
when it is interchangeable with what its own encoder would produce: the same fingerprint
(vision weights, vision and preprocessing configuration, dtype, layout), modality "image",
shape ``[num_image_tokens, hidden_size]``, dtype and layout. Everything is checked before
acceptance, each refusal an ``InvalidRequestError`` naming the field; nothing is fetched here.

``mm_hash`` and its algorithm are the media identity (``sources.py``) split in two:
``sha256:<hex>`` ↔ ("refengine-rgb8-sha256", hex), ``uuid:<uuid>`` ↔ ("uuid", uuid).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from refengine.multimodal.sources import MAX_UUID_BYTES
from refengine.types import EmbeddingHandleSpec, InvalidRequestError

SHA256_ALGORITHM, UUID_ALGORITHM = "refengine-rgb8-sha256", "uuid"
MAX_HANDLE_ID_BYTES = 256
_HEX64 = re.compile(r"[0-9a-f]{64}")


def split_identity(identity: str) -> tuple[str, str]:
    """A media identity as (mm_hash, mm_hash_algorithm)."""
    kind, _, value = identity.partition(":")
    return value, UUID_ALGORITHM if kind == "uuid" else SHA256_ALGORITHM


@dataclass(frozen=True)
class HandleExpectation:
    """What this consumer's own encoder would produce."""

    fingerprint: str
    num_tokens: int
    hidden_size: int
    dtype: str
    layout: str


def check_handles(handles: Sequence[EmbeddingHandleSpec], expected: HandleExpectation,
                  backends: tuple[str, ...] | None) -> None:
    """Refuse any handle this consumer cannot use. ``backends``: the transfer backends it pulls
    with (a handle must offer one); None for a consumer that never pulls (decode).

    A handle used twice is pulled once, and the pull checks one copy's ``mm_hash`` against what
    the encoder holds; so every copy must be the same handle. A copy naming another item would
    otherwise get this item's rows under that item's prefix-cache key (ENC13)."""
    first_use: dict[str, EmbeddingHandleSpec] = {}
    for index, handle in enumerate(handles):
        where = f"extra media handle {index}"
        _check_identity(handle, where)
        if first_use.setdefault(handle.handle_id, handle) != handle:
            raise InvalidRequestError(f"{where}: handle_id {handle.handle_id!r} is repeated with other fields; "
                                      "a handle used twice must be sent the same both times")
        if handle.modality != "image":
            raise InvalidRequestError(f"{where}: modality {handle.modality!r} is not supported (image only)")
        if handle.fingerprint != expected.fingerprint:
            raise InvalidRequestError(f"{where}: fingerprint {handle.fingerprint[:16]!r}… is not this model's "
                                      f"({expected.fingerprint[:16]}…): it was encoded with other vision weights, "
                                      "preprocessing, dtype or layout")
        shape = (expected.num_tokens, expected.hidden_size)
        if tuple(handle.shape) != shape:
            raise InvalidRequestError(f"{where}: shape {list(handle.shape)} is not {list(shape)} "
                                      "(num_image_tokens, hidden_size)")
        if handle.dtype != expected.dtype or handle.layout != expected.layout:
            raise InvalidRequestError(f"{where}: dtype/layout {handle.dtype!r}/{handle.layout!r} are not "
                                      f"{expected.dtype!r}/{expected.layout!r}")
        if backends is not None and not any(t.backend in backends and t.endpoints for t in handle.transfers):
            offered = [t.backend for t in handle.transfers]
            raise InvalidRequestError(f"{where}: offers no transfer this engine can pull with (offered {offered}, "
                                      f"with an endpoint; here {list(backends)})")


def _check_identity(handle: EmbeddingHandleSpec, where: str) -> None:
    if not handle.handle_id or len(handle.handle_id.encode()) > MAX_HANDLE_ID_BYTES:
        raise InvalidRequestError(f"{where}: handle_id must be 1 to {MAX_HANDLE_ID_BYTES} bytes")
    if handle.mm_hash_algorithm == SHA256_ALGORITHM:
        if not _HEX64.fullmatch(handle.mm_hash):
            raise InvalidRequestError(f"{where}: mm_hash must be 64 lowercase hex digits for {SHA256_ALGORITHM}")
    elif handle.mm_hash_algorithm == UUID_ALGORITHM:
        if not handle.mm_hash or len(handle.mm_hash.encode()) > MAX_UUID_BYTES:
            raise InvalidRequestError(f"{where}: mm_hash must be 1 to {MAX_UUID_BYTES} bytes for uuid")
    else:
        raise InvalidRequestError(f"{where}: mm_hash_algorithm {handle.mm_hash_algorithm!r} is not one of "
                                  f"{SHA256_ALGORITHM!r}, {UUID_ALGORITHM!r}")
