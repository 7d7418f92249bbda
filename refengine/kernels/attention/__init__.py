"""Attention over the paged KV cache, and the choice of backend."""

from __future__ import annotations

import logging

import torch

from refengine.config import ATTENTION_BACKENDS
from refengine.kernels.attention.base import AttentionBackend, AttentionMetadata
from refengine.kernels.attention.torch_ref import TorchReferenceBackend

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "TorchReferenceBackend",
           "make_attention_backend"]

logger = logging.getLogger(__name__)


def make_attention_backend(name: str, dtype: torch.dtype, device: str) -> AttentionBackend:
    """``auto`` takes the native CPU kernel for float32 on CPU when it builds (logging why
    not otherwise) and the torch reference everywhere else; ``cpu`` insists on it."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}")
    if name == "torch":
        return TorchReferenceBackend()
    from refengine.kernels.attention.cpu_paged import CpuPagedBackend, native_kernel_unavailable_reason

    fits = dtype == torch.float32 and torch.device(device).type == "cpu"
    reason = native_kernel_unavailable_reason() if fits else f"it needs float32 on CPU, not {dtype} on {device}"
    if not reason:
        return CpuPagedBackend()
    if name == "cpu":
        raise ValueError(f"attention backend 'cpu' is unavailable: {reason}")
    logger.info("native CPU attention not used (%s); using the torch reference", reason)
    return TorchReferenceBackend()
