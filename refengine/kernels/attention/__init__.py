"""Attention over the paged KV cache, and the choice of backend (``registry.py``)."""

from __future__ import annotations

from refengine.config import ATTENTION_BACKENDS
from refengine.kernels.attention.base import AttentionBackend, AttentionMetadata
from refengine.kernels.attention.registry import (
    available_backends,
    make_attention_backend,
    register_backend,
    unavailable_reason,
)
from refengine.kernels.attention.torch_ref import TorchReferenceBackend

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "TorchReferenceBackend",
           "available_backends", "make_attention_backend", "register_backend",
           "unavailable_reason"]
