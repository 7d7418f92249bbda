"""Rotary position embeddings, including Llama 3.1's frequency scaling.

The cos/sin tables are computed once for every position in float32, the way the
Hugging Face reference computes them, and indexed by position.
"""

from __future__ import annotations

import math

import torch

from refengine.config import ModelConfig
from refengine.kernels.fused import FusedOps


def _llama3_scaled_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, blend between."""
    factor = scaling["factor"]
    low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype, device: str,
                 ops: FusedOps | None = None) -> None:
        self.ops = ops or FusedOps()
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if config.rope_scaling is not None:  # llama3, with every key it needs (ModelConfig checks)
            inv_freq = _llama3_scaled_inv_freq(inv_freq, config.rope_scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32).unsqueeze(1) * inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        half = dim // 2
        self.cos = emb.cos().to(dtype=dtype, device=device)
        sin = emb.sin()
        # rotate_half(x) * sin == roll(x, half) * [-sin_low, sin_high]: one op fewer per call.
        self.signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(dtype=dtype, device=device)

    def apply_(self, x: torch.Tensor, positions: torch.Tensor) -> None:
        """Rotate x ``[T, heads, D]`` (queries and keys together) in place; rotate-half
        layout, as Hugging Face Llama."""
        self.ops.rotary_(x, positions, self.cos, self.signed_sin)
