"""``ForwardContext``: the per-step facts every layer of a forward pass may need.

One is made per step by the model runner and passed down through the model's
forward to every layer and projection, so that a new per-step fact (such as the
LoRA adapter slot of each token) reaches the layers that need it without changing
every signature in between. It holds only what some layer reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refengine.kernels.attention.base import AttentionBackend
from refengine.kernels.lora import LoraBatch


@dataclass(frozen=True)
class ForwardContext:
    attention: AttentionBackend  # already prepared for this step (``prepare(metadata)``)
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (key cache, value cache)
    # The step's adapter tokens grouped by LoRA slot (None: no token uses an adapter).
    lora: LoraBatch | None = None
