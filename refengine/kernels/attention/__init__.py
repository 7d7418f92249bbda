"""Attention over the paged KV cache."""

from refengine.kernels.attention.base import AttentionBackend, AttentionMetadata
from refengine.kernels.attention.torch_ref import TorchReferenceBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchReferenceBackend"]
