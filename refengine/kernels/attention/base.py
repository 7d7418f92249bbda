"""The attention-backend interface.

A step's tokens are laid out sequence after sequence: sequence ``i`` owns query
rows ``query_start_loc[i] : query_start_loc[i + 1]`` and after this step holds
``seq_lens[i]`` tokens of context (the cached ones first, then the new ones). So
query row ``r`` of sequence ``i`` sits at position ``seq_lens[i] - query_len_i + r``
and attends to positions ``0 … that position`` (causal).

Token position ``p`` of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``; ``slot_mapping``
gives that slot for every new token. How a block stores its tokens is the
backend's choice (``kv_cache_shapes``); the default, per layer, is
``[num_blocks, block_size, num_kv_heads, head_dim]`` for keys and the same for
values. Dimension 0 is always the block, so copying or moving whole blocks
(copy-on-write, preemption) never needs to know the layout.

CUDA graphs stay out of the choice of backend (as in mini-sglang): the runner owns
capture and replay and calls the ``*cuda_graph*`` / ``prepare_for_*`` hooks below; a
backend that cannot be captured keeps their no-op defaults and says so through
``supports_cuda_graphs``. On CPU there are no graphs: the hooks are never needed.
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

    def kv_cache_shapes(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of one layer's key and value cache tensors (dimension 0 = block)."""
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return shape, shape

    def kv_layout_name(self, head_dim: int, block_size: int) -> str:
        """Names the layout ``kv_cache_shapes`` gives, for the KV layout string engines compare
        before moving blocks between them (``KvBlockIO.layout``): a backend with more than one
        layout names each, since their shapes can coincide."""
        return type(self).__name__

    @property
    def supports_cuda_graphs(self) -> bool:
        """Whether decode steps through this backend may be captured in CUDA graphs and
        replayed (it implements the three hooks below). False for the CPU backends."""
        return False

    def init_cuda_graph_state(self, max_num_seqs: int, max_num_blocks_per_seq: int) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Allocate, once, the buffers a captured graph reads (block tables ``[max_num_seqs,
        max_num_blocks_per_seq]``, sequence lengths, any workspace) at fixed addresses: a
        replay cannot see tensors made after capture. A no-op on CPU."""

    def prepare_for_capture(self, num_seqs: int) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Before capturing the decode graph for a batch of ``num_seqs`` one-token
        sequences: point the backend's per-step state at slices of the graph buffers
        (filled with placeholder values), so ``forward`` records reads of those buffers.
        A no-op on CPU."""

    def prepare_for_replay(self, meta: AttentionMetadata) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Instead of ``prepare`` before replaying a captured graph: copy this step's
        metadata into the graph buffers in place (padding the batch to the captured
        size), allocating nothing. A no-op on CPU."""

    def graph_step_ineligible_reason(self, seq_lens: list[int], block_size: int) -> str:
        """Why a decode step with these sequence lengths must run eagerly although its shape
        fits a captured graph ("" = it may replay): for a backend whose eager path would launch
        it differently from the graph (Triton's split-KV). "" by default."""
        return ""

    @abstractmethod
    def prepare(self, meta: AttentionMetadata) -> None:
        """Called once per step, before any layer: derive per-step index tensors."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # shaped as kv_cache_shapes says
        v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Attention for one layer of the prepared step."""
