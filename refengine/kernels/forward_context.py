"""``ForwardContext``: the per-step facts every layer of a forward pass may need.

One is made per step by the model runner and passed down through the model's
forward to every layer and projection, so that a new per-step fact (the LoRA
adapter slot of each token, a tensor-parallel group) reaches the layers that need
it without changing every signature in between.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refengine.kernels.attention.base import AttentionBackend, AttentionMetadata
from refengine.kernels.lora import LoraBatch


@dataclass(frozen=True)
class ForwardContext:
    attention: AttentionBackend  # already prepared for this step (``prepare(attn_metadata)``)
    attn_metadata: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (key cache, value cache)
    # The step's adapter tokens grouped by LoRA slot (None: no token uses an adapter).
    lora: LoraBatch | None = None
    # The tensor-parallel group a sharded layer reduces over (None: a single rank).
    tp_group: object | None = None
