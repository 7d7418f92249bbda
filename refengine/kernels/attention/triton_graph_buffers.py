"""The fixed buffers a captured decode graph of the Triton backend reads (``triton_paged.py``).

A CUDA graph replays its kernels with the arguments they were captured with, so every per-step
index tensor the kernels read must sit at a fixed address and be refilled in place before each
replay. For a decode-only step (one query row per sequence) those are: the query starts
(``0, 1, ..., n``, never changing), the sequence lengths, the block tables, the slots of the new
keys and values, and the work list (item ``i`` = sequence ``i``, row 0, never changing). A
captured size ``n`` reads the first ``n`` rows of each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refengine.kernels.attention.base import AttentionMetadata


@dataclass(frozen=True)
class TritonGraphBuffers:
    query_start_loc: torch.Tensor  # [max_num_seqs + 1] int32: 0, 1, ..., max_num_seqs
    seq_lens: torch.Tensor  # [max_num_seqs] int32
    block_tables: torch.Tensor  # [max_num_seqs, max_num_blocks_per_seq] int32
    slot_mapping: torch.Tensor  # [max_num_seqs] int64
    work_seq: torch.Tensor  # [max_num_seqs] int32: 0, 1, ..., max_num_seqs - 1
    work_row: torch.Tensor  # [max_num_seqs] int32: zeros

    @classmethod
    def allocate(cls, max_num_seqs: int, max_num_blocks_per_seq: int, device: torch.device) -> TritonGraphBuffers:
        """Placeholder values that are safe to read: length 1, every block 0, slot 0."""
        steps = torch.arange(max_num_seqs + 1, dtype=torch.int32, device=device)
        return cls(query_start_loc=steps, seq_lens=torch.ones(max_num_seqs, dtype=torch.int32, device=device),
                   block_tables=torch.zeros(max_num_seqs, max_num_blocks_per_seq, dtype=torch.int32, device=device),
                   slot_mapping=torch.zeros(max_num_seqs, dtype=torch.int64, device=device),
                   work_seq=steps[:max_num_seqs].clone(),
                   work_row=torch.zeros(max_num_seqs, dtype=torch.int32, device=device))

    def load(self, meta: AttentionMetadata) -> None:
        """Copy a decode-only step (padded by the caller to a captured size) into the first rows,
        in place; block-table columns past the step's width become block 0 (past every length)."""
        num_seqs, width = meta.block_tables.shape
        assert meta.query_start_loc == list(range(num_seqs + 1)), "graph replay takes decode-only steps"
        fits = num_seqs <= self.seq_lens.numel() and width <= self.block_tables.shape[1]
        assert fits, "the step outgrows the buffers"
        self.block_tables[:num_seqs, :width].copy_(meta.block_tables)
        if width < self.block_tables.shape[1]:
            self.block_tables[:num_seqs, width:].zero_()
        self.seq_lens[:num_seqs].copy_(torch.tensor(meta.seq_lens, dtype=torch.int32))
        self.slot_mapping[:num_seqs].copy_(meta.slot_mapping)
