"""The attention-backend interface.

A step's tokens are laid out sequence after sequence: sequence ``i`` owns query
rows ``query_start_loc[i] : query_start_loc[i + 1]`` and after this step holds
``seq_lens[i]`` tokens of context (the cached ones first, then the new ones). So
query row ``r`` of sequence ``i`` sits at position ``seq_lens[i] - query_len_i + r``
and attends to positions ``0 … that position`` (causal).

KV cache layout, per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``
for keys and the same for values. Token position ``p`` of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``; ``slot_mapping``
gives that slot for every new token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: list[int]  # len num_seqs + 1
    seq_lens: list[int]  # len num_seqs
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int64, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def query_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]


class AttentionBackend(ABC):
    """Computes attention for one step over the paged cache.

    Invariant: ``forward`` first stores the new tokens' keys and values in the
    cache at ``slot_mapping``, then each query attends to every earlier-or-equal
    position of its own sequence (cached and new), never to another sequence's.
    """

    @abstractmethod
    def prepare(self, meta: AttentionMetadata) -> None:
        """Called once per step, before any layer: derive per-step index tensors."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Attention for one layer of the prepared step."""
