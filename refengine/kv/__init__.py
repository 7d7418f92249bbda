"""Paged KV cache: block pool, prefix-cache hashing, per-sequence block tables."""
