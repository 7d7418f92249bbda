"""The runner's KV cache as raw blocks, for KV transfer (``kv.transfer.base.BlockStore``).

Every attention backend keeps, per layer, a K and a V tensor whose first dimension is
the block id, so block ``b`` of one tensor is one contiguous byte range: regions are
ordered layer 0 K, layer 0 V, layer 1 K, … and a block's bytes on the wire are its
range in each region, in that order.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from refengine.kv.transfer.base import KvRegion


class KvBlockIO:
    def __init__(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], backend_name: str) -> None:
        self._tensors = [t for pair in kv_caches for t in pair]
        for t in self._tensors:
            assert t.is_contiguous(), "KV tensors are allocated contiguous, block dimension first"
        k, v = kv_caches[0]
        self.layout = f"{backend_name}:k{list(k.shape[1:])}:v{list(v.shape[1:])}:layers{len(kv_caches)}"
        self.dtype = str(k.dtype).removeprefix("torch.")
        self.regions = tuple(
            KvRegion(t.data_ptr(), t.shape[0], t[0].numel() * t.element_size()) for t in self._tensors)
        self.block_nbytes = sum(r.block_nbytes for r in self.regions)

    def read(self, block_ids: Sequence[int]) -> bytes:
        """The blocks' bytes, block-major (a block's range in every region, then the next)."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self._tensors[0].device)
        parts = [t.index_select(0, index).reshape(len(block_ids), -1).view(torch.uint8) for t in self._tensors]
        return torch.cat(parts, dim=1).cpu().numpy().tobytes()

    def write(self, block_ids: Sequence[int], data: bytes | memoryview) -> None:
        """Store ``data`` (as ``read`` returns it) into ``block_ids``."""
        num_blocks = len(block_ids)
        if len(data) != num_blocks * self.block_nbytes:
            raise ValueError(f"{len(data)} bytes for {num_blocks} blocks of {self.block_nbytes}")
        with warnings.catch_warnings():  # a read-only buffer: only ever read from here
            warnings.simplefilter("ignore", UserWarning)
            rows = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).reshape(num_blocks, self.block_nbytes))
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self._tensors[0].device)
        offset = 0
        for t, region in zip(self._tensors, self.regions, strict=True):
            part = rows[:, offset:offset + region.block_nbytes].contiguous().view(t.dtype)
            t.index_copy_(0, index, part.view(num_blocks, *t.shape[1:]).to(t.device))
            offset += region.block_nbytes
