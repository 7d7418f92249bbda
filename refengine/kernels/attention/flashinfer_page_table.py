"""A step's page table in FlashInfer's terms (``flashinfer_backend.py``, "Per step"): a pure
function of the ``AttentionMetadata``, so it is tested on any machine without FlashInfer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refengine.kernels.attention.base import AttentionMetadata


@dataclass(frozen=True)
class PagedKvPlan:
    """One step in FlashInfer's page-table terms (see the module docstring). int32 index
    tensors: the indptrs and last-page lengths on the CPU, the page indices on the block
    tables' device; ``slot_mapping`` as given."""

    qo_indptr: torch.Tensor  # [num_seqs + 1]
    paged_kv_indptr: torch.Tensor  # [num_seqs + 1]
    paged_kv_indices: torch.Tensor  # [paged_kv_indptr[-1]]
    paged_kv_last_page_len: torch.Tensor  # [num_seqs], each in 1 … page_size
    slot_mapping: torch.Tensor  # [num_tokens] int64
    page_size: int
    num_tokens: int
    decode_only: bool  # every sequence has exactly one query token (and there is one)

    @property
    def num_seqs(self) -> int:
        return self.paged_kv_last_page_len.numel()


def paged_kv_plan(meta: AttentionMetadata) -> PagedKvPlan:
    """FlashInfer's ``qo_indptr`` / ``paged_kv_indptr`` / ``paged_kv_indices`` /
    ``paged_kv_last_page_len`` for ``meta``. Pure (no FlashInfer, any device); raises
    ValueError for metadata that breaks the interface's invariants."""
    page_size, num_seqs = meta.block_size, meta.num_seqs
    starts = list(meta.query_start_loc)
    if page_size < 1 or len(starts) != num_seqs + 1 or (starts and starts[0] != 0):
        raise ValueError(f"bad step layout: block_size {page_size}, query_start_loc {starts}, {num_seqs} seqs")
    max_blocks = meta.block_tables.shape[1] if meta.block_tables.dim() == 2 else 0
    page_counts, last_page_lens, flat = [], [], []
    for i, seq_len in enumerate(meta.seq_lens):
        query_len = starts[i + 1] - starts[i]
        if seq_len < 1 or not 0 <= query_len <= seq_len:
            raise ValueError(f"sequence {i}: query length {query_len} with {seq_len} tokens of context")
        pages = -(-seq_len // page_size)
        if pages > max_blocks:
            raise ValueError(f"sequence {i}: {seq_len} tokens need {pages} blocks, the table has {max_blocks}")
        page_counts.append(pages)
        last_page_lens.append(seq_len - (pages - 1) * page_size)
        flat.extend(range(i * max_blocks, i * max_blocks + pages))
    num_tokens = starts[-1] if starts else 0
    if meta.slot_mapping.numel() != num_tokens:
        raise ValueError(f"{meta.slot_mapping.numel()} slots for {num_tokens} query tokens")
    indptr = [0]
    for pages in page_counts:
        indptr.append(indptr[-1] + pages)
    device = meta.block_tables.device
    flat_index = torch.tensor(flat, dtype=torch.int64).to(device)
    indices = meta.block_tables.reshape(-1).index_select(0, flat_index).to(torch.int32)
    return PagedKvPlan(
        qo_indptr=torch.tensor(starts, dtype=torch.int32),
        paged_kv_indptr=torch.tensor(indptr, dtype=torch.int32),
        paged_kv_indices=indices,
        paged_kv_last_page_len=torch.tensor(last_page_lens, dtype=torch.int32),
        slot_mapping=meta.slot_mapping,
        page_size=page_size,
        num_tokens=num_tokens,
        decode_only=num_seqs > 0 and all(starts[i + 1] - starts[i] == 1 for i in range(num_seqs)),
    )
