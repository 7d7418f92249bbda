"""The step's token bitmask: one ``[rows, ceil(vocab / 32)]`` int32 tensor for all sampling
rows, filled by each guided row's matcher, applied to the logits in one call.

Rows without a grammar are never touched: ``apply_bitmask`` names only the guided rows.
"""

from __future__ import annotations

import torch
import xgrammar

BITS = 32


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """All bits set (every token allowed), so an unfilled row masks nothing."""
    return torch.full((num_rows, (vocab_size + BITS - 1) // BITS), -1, dtype=torch.int32)


def num_allowed(bitmask: torch.Tensor, row: int, vocab_size: int) -> int:
    """How many of the first ``vocab_size`` tokens row ``row`` allows."""
    words = bitmask[row].to(torch.int64) & 0xFFFFFFFF
    bits = (words[:, None] >> torch.arange(BITS)) & 1
    return int(bits.flatten()[:vocab_size].sum())


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set ``logits[r, t] = -inf`` for every token ``t`` whose bit is clear, for ``r`` in
    ``rows``, in place (xgrammar's kernel for the logits' device, CPU or CUDA, with ``bitmask`` on
    that device; it takes the bitmask layout both backends use)."""
    if rows:
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)

