"""The fixed buffers a captured decode graph of the Triton backend reads (``triton_paged.py``).

Those of every capturable backend (``graph_buffers.py``: block tables, sequence lengths, slots),
int32 as the kernels read them, and two that a decode-only step never changes: the query starts
(``0, 1, ..., n``) and the work list (item ``i`` = sequence ``i``, row 0).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from refengine.kernels.attention.graph_buffers import DecodeGraphBuffers


@dataclass(frozen=True)
class TritonGraphBuffers(DecodeGraphBuffers):
    query_start_loc: torch.Tensor  # [max_num_seqs + 1] int32: 0, 1, ..., max_num_seqs
    work_seq: torch.Tensor  # [max_num_seqs] int32: 0, 1, ..., max_num_seqs - 1
    work_row: torch.Tensor  # [max_num_seqs] int32: zeros

    @classmethod
    def allocate(cls, max_num_seqs: int, max_num_blocks_per_seq: int, device: torch.device,
                 index_dtype: torch.dtype = torch.int32) -> TritonGraphBuffers:
        shared = DecodeGraphBuffers.allocate(max_num_seqs, max_num_blocks_per_seq, device, index_dtype)
        steps = torch.arange(max_num_seqs + 1, dtype=torch.int32, device=device)
        return cls(**{f.name: getattr(shared, f.name) for f in fields(shared)}, query_start_loc=steps,
                   work_seq=steps[:max_num_seqs].clone(),
                   work_row=torch.zeros(max_num_seqs, dtype=torch.int32, device=device))
