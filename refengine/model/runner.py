"""The model runner: a scheduler decision in, logits out.

Stateless over requests: it owns the weights and the KV cache tensors, turns the
scheduled sequences into flat input tensors (token ids, positions, slot mapping,
block tables), runs the model and returns logits for the rows the engine needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from refengine.config import CacheConfig, ModelConfig
from refengine.kernels.attention import AttentionMetadata, TorchReferenceBackend
from refengine.kernels.attention.base import AttentionBackend
from refengine.model.llama import LlamaModel
from refengine.scheduler.scheduler import ScheduledSequence

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * element_size


@dataclass(frozen=True)
class StepLogits:
    """One step's logits, computed once as one tensor: ``values`` ``[rows, vocab]``
    float32, and per scheduled sequence the ``[start, end)`` rows it owns (``None``:
    it produced none). Indexing by sequence gives a view, never a copy."""

    values: torch.Tensor | None
    row_ranges: list[tuple[int, int] | None]

    def __getitem__(self, i: int) -> torch.Tensor | None:
        rows = self.row_ranges[i]
        return None if rows is None or self.values is None else self.values[rows[0] : rows[1]]

    def __len__(self) -> int:
        return len(self.row_ranges)


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        cache: CacheConfig,
        max_model_len: int,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        attention: AttentionBackend | None = None,
    ) -> None:
        weights = {name: w.to(dtype=dtype, device=device) for name, w in weights.items()}
        self.config = config
        self.device = device
        self.block_size = cache.block_size
        self.model = LlamaModel(config, weights, max_positions=max_model_len)
        self.num_blocks = cache.num_blocks or max(1, cache.kv_memory_bytes // kv_bytes_per_block(
            config, cache.block_size, dtype))
        self.attention = attention or TorchReferenceBackend()
        k_shape, v_shape = self.attention.kv_cache_shapes(
            self.num_blocks, cache.block_size, config.num_key_value_heads, config.head_dim)
        self.kv_caches = [
            (torch.zeros(k_shape, dtype=dtype, device=device), torch.zeros(v_shape, dtype=dtype, device=device))
            for _ in range(config.num_hidden_layers)
        ]

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks before a step writes into them."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    @torch.inference_mode()
    def execute(self, scheduled: Sequence[ScheduledSequence], want_all_logits: Sequence[bool]) -> StepLogits:
        """Run one step. Per scheduled sequence, logits for every query row
        (``want_all_logits``, for prompt logprobs), or for the last row when the
        sequence samples this step, or none."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens = []
        bs = self.block_size
        for item in scheduled:
            seq = item.seq
            start, end = item.start, item.start + item.num_new_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
        max_blocks = max(len(item.seq.block_table) for item in scheduled)
        block_tables = torch.tensor(
            [item.seq.block_table + [0] * (max_blocks - len(item.seq.block_table)) for item in scheduled],
            dtype=torch.int64,
        )
        meta = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables.to(self.device),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=self.device),
            block_size=bs,
        )
        self.attention.prepare(meta)
        hidden = self.model.forward(
            torch.tensor(input_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            self.attention,
            self.kv_caches,
        )
        # Only the rows that are needed go through the (large) vocabulary projection.
        row_ranges: list[tuple[int, int] | None] = []
        rows: list[int] = []
        for i, item in enumerate(scheduled):
            start, end = query_start_loc[i], query_start_loc[i + 1]
            if want_all_logits[i]:
                row_ranges.append((len(rows), len(rows) + end - start))
                rows.extend(range(start, end))
            elif item.samples:
                row_ranges.append((len(rows), len(rows) + 1))
                rows.append(end - 1)
            else:
                row_ranges.append(None)
        if not rows:
            return StepLogits(None, row_ranges)
        return StepLogits(self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]).cpu(), row_ranges)
