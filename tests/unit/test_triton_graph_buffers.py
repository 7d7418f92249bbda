"""The fixed buffers of the Triton backend's CUDA graph mode (``kernels/attention/triton_graph_buffers.py``).

A replay reads what ``load`` left in them, so a step must land in the first rows in place (the
tensors are never replaced), narrower block tables must not leave an earlier step's columns
behind, and only decode-only steps that fit are taken. The kernels' side (graph mode computing
the eager step bit for bit) is tests/unit/test_triton_attention.py's.
"""

from __future__ import annotations

import pytest
import torch

from refengine.kernels.attention import AttentionMetadata
from refengine.kernels.attention.triton_graph_buffers import TritonGraphBuffers


def decode(seq_lens: list[int], tables: list[list[int]], slots: list[int]) -> AttentionMetadata:
    return AttentionMetadata(list(range(len(seq_lens) + 1)), seq_lens, torch.tensor(tables), torch.tensor(slots), 16)


def test_a_step_lands_in_place_and_clears_the_columns_it_does_not_use() -> None:
    buffers = TritonGraphBuffers.allocate(4, 5, torch.device("cpu"))
    addresses = [t.data_ptr() for t in (buffers.seq_lens, buffers.block_tables, buffers.slot_mapping)]
    assert buffers.query_start_loc.tolist() == [0, 1, 2, 3, 4] and buffers.work_seq.tolist() == [0, 1, 2, 3]
    assert buffers.work_row.tolist() == [0, 0, 0, 0] and buffers.seq_lens.tolist() == [1, 1, 1, 1]
    buffers.load(decode([40, 17, 3], [[7, 8, 9, 10, 11], [3, 4, 0, 0, 0], [5, 0, 0, 0, 0]], [651, 64, 82]))
    buffers.load(decode([33, 18], [[12, 13, 14], [1, 2, 0]], [544, 33]))
    assert [t.data_ptr() for t in (buffers.seq_lens, buffers.block_tables, buffers.slot_mapping)] == addresses
    assert buffers.block_tables.dtype == torch.int32 and buffers.seq_lens.dtype == torch.int32
    assert buffers.block_tables[:2].tolist() == [[12, 13, 14, 0, 0], [1, 2, 0, 0, 0]]
    assert buffers.seq_lens[:2].tolist() == [33, 18] and buffers.slot_mapping[:2].tolist() == [544, 33]


def test_only_decode_only_steps_that_fit_are_taken() -> None:
    buffers = TritonGraphBuffers.allocate(2, 3, torch.device("cpu"))
    chunk = AttentionMetadata([0, 2], [5], torch.tensor([[1]]), torch.tensor([3, 4]), 16)
    with pytest.raises(AssertionError, match="decode-only"):
        buffers.load(chunk)
    with pytest.raises(AssertionError, match="outgrows"):
        buffers.load(decode([5, 6, 7], [[1], [2], [3]], [4, 5, 6]))
    with pytest.raises(AssertionError, match="outgrows"):
        buffers.load(decode([70], [[1, 2, 3, 4, 5]], [68]))
