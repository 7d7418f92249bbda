"""Reproducible prefix-cache block keys, for routers that compute them offline.

A full block's key is ``sha256`` over, in order:

1. the parent block's 32-byte key, or 32 zero bytes for a prompt's first block;
2. the block's ``block_size`` token ids, each a little-endian unsigned 32-bit integer;
3. for each extra key, in order: its UTF-8 length as a little-endian unsigned 32-bit
   integer, then its UTF-8 bytes.

The engine's extra keys (``engine_extra_keys``) are the model fingerprint (a digest of the
weights and config as run, ``loader.model_fingerprint``, the same in every process serving those
files alike; a consumer reads it as ``extra_keys[0]`` of any stored block), then
``"salt:<cache_salt>"`` when the request has a salt, then ``"lora:<digest>"`` when it runs
with a LoRA adapter (the first 32 hex digits of the SHA-256 of ``adapter_config.json``'s bytes
followed by ``adapter_model.safetensors``'s: the same files give the same key whatever id or
name they were loaded under). A block that holds positions of a media
item (an image's run of embedding positions) then adds ``"media:<identity>"`` for each such
item (``uuid:<uuid>`` or ``sha256:<digest>``, see ``multimodal/sources.py``); the blocks
after it differ through the parent chain. Nothing is process-random, so keys are
identical across restarts, processes and replicas for the same model and the same tokens.

On the wire: ``KvBlockHash`` ``{value: the 32 bytes, encoding: "bytes"}`` on the native
stream; vLLM-compatible (ZMQ) consumers get the unsigned 64-bit integer of the key's last
8 bytes, big-endian (``block_hash_u64``: its low 64 bits, as vLLM converts).
"""

from __future__ import annotations

from collections.abc import Sequence

from refengine.kv.prefix_hash import MediaSpan, hash_full_blocks


def engine_extra_keys(model_fingerprint: str, cache_salt: str | None = None,
                      lora_key: str | None = None) -> tuple[str, ...]:
    """The extra keys the engine hashes into every block of a request (``lora_key``:
    ``LoadedLora.cache_key``)."""
    return (model_fingerprint,) + ((f"salt:{cache_salt}",) if cache_salt else ()) + ((lora_key,) if lora_key else ())


def block_keys(token_ids: Sequence[int], block_size: int, extra_keys: tuple[str, ...],
               media_spans: Sequence[MediaSpan] = ()) -> list[bytes]:
    """The keys of every full block of ``token_ids`` (a trailing partial block has none).
    ``media_spans``: ``(first, end, identity)`` of each media item's run of positions in the
    expanded prompt; a block holding any of them adds ``"media:<identity>"`` to its keys."""
    return hash_full_blocks(token_ids, block_size, extra_keys, [], media_spans=media_spans)


def block_hash_u64(key: bytes) -> int:
    """The integer form of a block key that vLLM-style consumers read: its low 64 bits, as
    vLLM's ``maybe_convert_block_hash`` takes them (``int.from_bytes(key, "big") & (2**64 - 1)``),
    so a consumer converting the native stream's 32-byte key that way gets the ZMQ stream's
    integer (the first 8 bytes were used until review found it)."""
    return int.from_bytes(key[-8:], "big")
