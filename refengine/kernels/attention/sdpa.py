"""Prefill-chunk attention through torch's SDPA, shared by the attention backends.

A chunk of ``query_len`` new tokens of a sequence that holds ``seq_len`` tokens
after the step attends causally; with no cached context (``query_len == seq_len``)
that is SDPA's plain causal case, otherwise the causal mask is offset by the context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def context_mask(seq_len: int, query_len: int) -> torch.Tensor | None:
    """``[query_len, seq_len]`` bool (True = attend) over the sequence's written positions;
    ``None`` when there is no cached context (plain causal). Callers cut the gathered keys
    and values to ``seq_len`` positions: a masked position still meets its value in SDPA's
    product (weight 0 times a stale NaN is NaN), so the slots past the last token, which may
    hold anything a block's earlier owner left, must not be passed at all."""
    if query_len == seq_len:
        return None
    query_pos = torch.arange(seq_len - query_len, seq_len).unsqueeze(1)
    return torch.arange(seq_len).unsqueeze(0) <= query_pos


def chunk_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                    scale: float) -> torch.Tensor:
    """query ``[L, H, D]``, keys/values ``[kv_heads, S, D]`` -> ``[L, H, D]``. With ``mask``
    ``None``, keys are exactly the chunk's own ``L`` positions (causal)."""
    # [1, H, L, D]: SDPA takes its fused CPU flash kernel only for 4-D inputs.
    attn = F.scaled_dot_product_attention(query.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
                                          is_causal=mask is None, scale=scale, enable_gqa=True)
    return attn[0].transpose(0, 1)
