"""The runner's KV cache as raw blocks, for KV transfer (``kv.transfer.base.BlockStore``).

Every attention backend keeps, per layer, a K and a V tensor whose first dimension is
the block id, so block ``b`` of one tensor is one contiguous byte range: regions are
ordered layer 0 K, layer 0 V, layer 1 K, … On the wire, some blocks' bytes are
region-major: every region's ranges of those blocks, region after region.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from refengine.kv.transfer.base import KvRegion


class KvBlockIO:
    def __init__(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], layout_name: str) -> None:
        self._tensors = [t for pair in kv_caches for t in pair]
        for t in self._tensors:
            assert t.is_contiguous(), "KV tensors are allocated contiguous, block dimension first"
        k, v = kv_caches[0]
        self.layout = f"{layout_name}:k{list(k.shape[1:])}:v{list(v.shape[1:])}:layers{len(kv_caches)}"
        self.dtype = str(k.dtype).removeprefix("torch.")
        self.regions = tuple(
            KvRegion(t.data_ptr(), t.shape[0], t[0].numel() * t.element_size()) for t in self._tensors)
        self.block_nbytes = sum(r.block_nbytes for r in self.regions)

    def read(self, block_ids: Sequence[int]) -> bytes:
        """The blocks' bytes, region-major: region 0's blocks in order, then region 1's, …
        (each region's part is one ``index_select`` straight into the output)."""
        num_blocks = len(block_ids)
        index = self._index(block_ids)
        out = torch.empty(num_blocks * self.block_nbytes, dtype=torch.uint8, device=self._tensors[0].device)
        for t, part in self._parts(out, num_blocks):
            torch.index_select(t, 0, index, out=part)
        return out.cpu().numpy().tobytes()

    def write(self, block_ids: Sequence[int], data: bytes | memoryview) -> None:
        """Store ``data`` (as ``read`` returns it) into ``block_ids``."""
        num_blocks = len(block_ids)
        if len(data) != num_blocks * self.block_nbytes:
            raise ValueError(f"{len(data)} bytes for {num_blocks} blocks of {self.block_nbytes}")
        with warnings.catch_warnings():  # a read-only buffer: only ever read from here
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(data, dtype=torch.uint8).to(self._tensors[0].device)
        index = self._index(block_ids)
        for t, part in self._parts(src, num_blocks):
            t.index_copy_(0, index, part)

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(block_ids), dtype=torch.long, device=self._tensors[0].device)

    def _parts(self, flat: torch.Tensor, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each KV tensor with its region's slice of ``flat``, shaped ``[num_blocks, …]`` like it."""
        parts, offset = [], 0
        for t, region in zip(self._tensors, self.regions, strict=True):
            size = num_blocks * region.block_nbytes
            parts.append((t, flat[offset:offset + size].view(t.dtype).view(num_blocks, *t.shape[1:])))
            offset += size
        return parts
