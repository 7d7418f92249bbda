"""Paged KV cache: block pool, prefix-cache hashing, per-sequence block tables.

``block_keys`` computes the engine's prefix-cache block keys offline (see ``keys.py``)."""

from refengine.kv.keys import block_hash_u64, block_keys, engine_extra_keys

__all__ = ["block_hash_u64", "block_keys", "engine_extra_keys"]
