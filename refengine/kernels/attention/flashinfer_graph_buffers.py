"""The fixed buffers a captured decode graph of the FlashInfer backend reads (``flashinfer_backend.py``).

FlashInfer's own contract for CUDA graphs: a decode wrapper made with ``use_cuda_graph=True`` is
handed its page-table buffers at construction and keeps their addresses; each ``plan`` copies the
step's ``paged_kv_indptr`` / ``paged_kv_indices`` / ``paged_kv_last_page_len`` into them, and ``run``
(the part that is captured) reads only them. Such a wrapper's batch size is fixed at the length of
its last-page buffer, so the backend makes one wrapper per captured size over the first rows of
these shared buffers. Only one graph replays at a time and every replay is planned first, so the
wrappers may share them. ``slot_mapping`` is ours: the slots the KV write of a graphed step reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FlashInferGraphBuffers:
    paged_kv_indptr: torch.Tensor  # [max_num_seqs + 1] int32
    paged_kv_indices: torch.Tensor  # [max_num_seqs * max_num_blocks_per_seq] int32
    paged_kv_last_page_len: torch.Tensor  # [max_num_seqs] int32
    slot_mapping: torch.Tensor  # [max_num_seqs] int64

    @property
    def max_num_seqs(self) -> int:
        return self.paged_kv_last_page_len.numel()

    @staticmethod
    def allocate(max_num_seqs: int, max_num_blocks_per_seq: int, device: torch.device) -> FlashInferGraphBuffers:
        """Placeholders that are safe to read (no pages, last-page length 1, slot 0); every replay
        plans first, which overwrites the rows it uses."""
        return FlashInferGraphBuffers(
            paged_kv_indptr=torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=device),
            paged_kv_indices=torch.zeros(max_num_seqs * max_num_blocks_per_seq, dtype=torch.int32, device=device),
            paged_kv_last_page_len=torch.ones(max_num_seqs, dtype=torch.int32, device=device),
            slot_mapping=torch.zeros(max_num_seqs, dtype=torch.int64, device=device))

    def wrapper_buffers(self, num_seqs: int) -> dict[str, torch.Tensor]:
        """The keyword arguments that give a graph-mode decode wrapper of ``num_seqs`` rows its
        buffers: the first rows of the indptr and last-page lengths, all of the indices."""
        return {"paged_kv_indptr_buffer": self.paged_kv_indptr[: num_seqs + 1],
                "paged_kv_indices_buffer": self.paged_kv_indices,
                "paged_kv_last_page_len_buffer": self.paged_kv_last_page_len[:num_seqs]}
