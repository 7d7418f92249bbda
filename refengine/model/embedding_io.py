"""Media embeddings as raw rows in host memory, for moving them between processes.

An ``EmbeddingArena`` is one contiguous ``[num_rows, hidden_size]`` tensor on the CPU (NIXL
registers it as DRAM) that serves as a ``kv.transfer.base.BlockStore`` whose blocks are rows:
the encoder keeps its handles' embeddings in one, and a consumer pulls into its own staging
arena before copying them out. So the KV transfer backends move embeddings unchanged. Rows
in ``layout``: ``hidden_size`` elements each, little-endian, in position order.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from refengine.kv.transfer.base import KvRegion

LAYOUT_VERSION = "refengine-embeddings/1"


def embedding_layout(hidden_size: int, dtype: torch.dtype) -> str:
    return f"{LAYOUT_VERSION}:row-major:{hidden_size}:{dtype_name(dtype)}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class EmbeddingArena:
    def __init__(self, num_rows: int, hidden_size: int, dtype: torch.dtype) -> None:
        self.rows = torch.zeros(num_rows, hidden_size, dtype=dtype)
        self.layout = embedding_layout(hidden_size, dtype)
        self.dtype = dtype_name(dtype)
        self.block_nbytes = hidden_size * self.rows.element_size()
        self.regions = (KvRegion(self.rows.data_ptr(), num_rows, self.block_nbytes),)

    @property
    def num_rows(self) -> int:
        return self.rows.shape[0]

    def _index(self, row_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(row_ids), dtype=torch.long)

    def put(self, row_ids: Sequence[int], values: torch.Tensor) -> None:
        """Store ``values`` ``[len(row_ids), hidden]`` (any device, this dtype) in the rows."""
        self.rows.index_copy_(0, self._index(row_ids), values.to(device="cpu", dtype=self.rows.dtype))

    def get(self, row_ids: Sequence[int]) -> torch.Tensor:
        """A copy of the rows, ``[len(row_ids), hidden]``."""
        return torch.index_select(self.rows, 0, self._index(row_ids))

    def read(self, block_ids: Sequence[int]) -> bytes:
        return self.get(block_ids).view(torch.uint8).numpy().tobytes()

    def write(self, block_ids: Sequence[int], data: bytes | memoryview) -> None:
        if len(data) != len(block_ids) * self.block_nbytes:
            raise ValueError(f"{len(data)} bytes for {len(block_ids)} rows of {self.block_nbytes}")
        with warnings.catch_warnings():  # a read-only buffer: only ever read from here
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(data, dtype=torch.uint8)
        self.rows.index_copy_(0, self._index(block_ids), src.view(self.rows.dtype).view(len(block_ids), -1))
