"""The fixed buffers a captured decode graph reads, shared by the backends that can be captured.

A CUDA graph replays its kernels with the arguments they were captured with, so every per-step
index tensor a backend reads must sit at a fixed address and be refilled in place before each
replay (``AttentionBackend.prepare_for_replay``). For a decode-only step those are the block
tables, the sequence lengths and the slots of the new keys and values; a captured size ``n``
reads the first ``n`` rows of each. Each backend keeps them in the index dtype its kernels read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from refengine.kernels.attention.base import AttentionMetadata


def graph_device(device: torch.device | str | None) -> torch.device:
    """Where a backend's graph buffers go: ``device``, or the current CUDA device for None (the
    runner's case; tests pass the CPU and run graph mode eagerly)."""
    return torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)


class CapturableBackend:
    """Graph-mode state shared by the capturable backends (mixed in before ``AttentionBackend``):
    ``_graph``, the backend's buffers (made by its ``init_cuda_graph_state``; they expose
    ``max_num_seqs``), and ``_graph_rows``, how many of their rows a captured ``forward`` reads
    (None: an eager step; the backend's ``prepare`` resets it)."""

    _graph: Any = None
    _graph_rows: int | None = None

    @property
    def supports_cuda_graphs(self) -> bool:
        return True

    def prepare_for_capture(self, num_seqs: int) -> None:
        """Graph mode over the buffers' first ``num_seqs`` rows, which keep their values (the
        runner fills them with its scratch-slot placeholder through ``prepare_for_replay``)."""
        assert self._graph is not None, "init_cuda_graph_state() must run before prepare_for_capture()"
        assert 1 <= num_seqs <= self._graph.max_num_seqs, f"{num_seqs} rows do not fit the graph buffers"
        self._graph_rows = num_seqs


@dataclass(frozen=True)
class DecodeGraphBuffers:
    block_tables: torch.Tensor  # [max_num_seqs, max_num_blocks_per_seq]
    seq_lens: torch.Tensor  # [max_num_seqs]
    slot_mapping: torch.Tensor  # [max_num_seqs] int64

    @property
    def max_num_seqs(self) -> int:
        return self.seq_lens.numel()

    @staticmethod
    def allocate(max_num_seqs: int, max_num_blocks_per_seq: int, device: torch.device,
                 index_dtype: torch.dtype) -> DecodeGraphBuffers:
        """Placeholder values that are safe to read: length 1, every block 0, slot 0."""
        return DecodeGraphBuffers(
            block_tables=torch.zeros(max_num_seqs, max_num_blocks_per_seq, dtype=index_dtype, device=device),
            seq_lens=torch.ones(max_num_seqs, dtype=index_dtype, device=device),
            slot_mapping=torch.zeros(max_num_seqs, dtype=torch.int64, device=device))

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
        self.seq_lens[:num_seqs].copy_(torch.tensor(meta.seq_lens, dtype=self.seq_lens.dtype))
        self.slot_mapping[:num_seqs].copy_(meta.slot_mapping)
