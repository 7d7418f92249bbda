"""The torch reference attention backend (CPU and GPU, any dtype).

Decode sequences (one query token) are batched into one padded
scaled-dot-product call; sequences with several query tokens (prefill chunks)
run one call each with a causal mask offset by their cached context. Keys and
values are gathered from the paged cache whole blocks at a time (one contiguous
copy per block, about twice as fast as gathering slot by slot); positions past a
sequence's length are masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from refengine.kernels.attention.base import AttentionBackend, AttentionMetadata
from refengine.kernels.attention.sdpa import chunk_attention, context_mask


@dataclass
class _PrefillPlan:
    query_rows: slice
    block_ids: torch.Tensor  # [num_blocks] the sequence's blocks, in order
    seq_len: int
    mask: torch.Tensor | None  # [query_len, num_blocks * block_size] bool, True = attend; None = plain causal


@dataclass
class _DecodePlan:
    query_rows: torch.Tensor | None  # [num_decodes]; None = every row of the step (a decode-only step)
    block_ids: torch.Tensor  # [num_decodes * max_blocks], row-major
    mask: torch.Tensor  # [num_decodes, 1, 1, max_blocks * block_size]


def _length_groups(meta: AttentionMetadata, seqs: list[int], max_padding: float = 1.5) -> list[list[int]]:
    """Split decode sequences into groups of similar length, so one padded call per
    group reads little padding: a group's longest context is at most ``max_padding``
    times its shortest (rounded up to whole blocks). One group when lengths are close."""
    if not seqs:
        return []
    by_len = sorted(seqs, key=lambda i: meta.seq_lens[i])
    groups = [[by_len[0]]]
    for i in by_len[1:]:
        shortest = max(meta.seq_lens[groups[-1][0]], meta.block_size)
        if meta.seq_lens[i] > max_padding * shortest:
            groups.append([])
        groups[-1].append(i)
    if len(groups) == 1:
        return [seqs]  # keep step order: a decode-only step then needs no scatter
    return groups


class TorchReferenceBackend(AttentionBackend):
    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._decodes: list[_DecodePlan] = []
        self._prefills: list[_PrefillPlan] = []

    def prepare(self, meta: AttentionMetadata) -> None:
        self._meta = meta
        self._prefills = []
        decode_seqs = []
        for i in range(meta.num_seqs):
            query_len = meta.query_len(i)
            if query_len == 1:
                decode_seqs.append(i)
                continue
            seq_len = meta.seq_lens[i]
            num_blocks = -(-seq_len // meta.block_size)
            mask = context_mask(seq_len, query_len, meta.block_size)
            rows = slice(meta.query_start_loc[i], meta.query_start_loc[i + 1])
            self._prefills.append(_PrefillPlan(rows, meta.block_tables[i, :num_blocks], seq_len, mask))
        self._decodes = [self._plan_decodes(meta, group) for group in _length_groups(meta, decode_seqs)]

    @staticmethod
    def _plan_decodes(meta: AttentionMetadata, seqs: list[int]) -> _DecodePlan:
        seq_lens = torch.tensor([meta.seq_lens[i] for i in seqs])
        num_blocks = -(-int(seq_lens.max()) // meta.block_size)
        block_ids = meta.block_tables[seqs][:, :num_blocks].reshape(-1)
        positions = torch.arange(num_blocks * meta.block_size)
        mask = (positions.unsqueeze(0) < seq_lens.unsqueeze(1))[:, None, None, :]
        all_rows = seqs == list(range(meta.num_seqs))
        rows = None if all_rows else torch.tensor([meta.query_start_loc[i] for i in seqs])
        return _DecodePlan(rows, block_ids, mask)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        assert self._meta is not None, "prepare() must run before forward()"
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        k_flat.index_copy_(0, self._meta.slot_mapping, k)
        v_flat.index_copy_(0, self._meta.slot_mapping, v)
        if len(self._decodes) == 1 and self._decodes[0].query_rows is None:  # decode-only: no scatter
            return self._decode_attention(q, k_cache, v_cache, self._decodes[0], scale)
        out = torch.empty_like(q)
        for plan in self._prefills:
            keys = k_cache.index_select(0, plan.block_ids).view(-1, num_kv_heads, head_dim).transpose(0, 1)
            values = v_cache.index_select(0, plan.block_ids).view(-1, num_kv_heads, head_dim).transpose(0, 1)
            if plan.mask is None:
                keys, values = keys[:, : plan.seq_len], values[:, : plan.seq_len]
            out[plan.query_rows] = chunk_attention(q[plan.query_rows], keys, values, plan.mask, scale)
        for decode in self._decodes:
            out[decode.query_rows] = self._decode_attention(q[decode.query_rows], k_cache, v_cache, decode, scale)
        return out

    @staticmethod
    def _decode_attention(q, k_cache, v_cache, plan: _DecodePlan, scale: float) -> torch.Tensor:
        """One padded SDPA call for all decode rows: q [B, H, D] -> [B, H, D]."""
        batch, num_kv_heads, head_dim = q.shape[0], k_cache.shape[2], k_cache.shape[3]
        keys = k_cache.index_select(0, plan.block_ids).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        values = v_cache.index_select(0, plan.block_ids).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        attn = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=plan.mask, scale=scale, enable_gqa=True
        )
        return attn.squeeze(2)
