"""The torch reference attention backend (CPU and GPU, any dtype).

Decode sequences (one query token) are batched into one padded
scaled-dot-product call; sequences with several query tokens (prefill chunks)
run one call each with a causal mask offset by their cached context. Keys and
values are gathered from the paged cache whole blocks at a time (one contiguous
copy per block, about twice as fast as gathering slot by slot); positions past a
sequence's length are masked. The cache may hold another dtype than the queries
(``--kv-cache-dtype``): keys and values are converted on the way in and on the way out,
and prefill reads the step's own keys back from the cache, so it sees them rounded just
as a later chunk or decode step will.

Not invariant to the bit: an SDPA call's reduction depends on its shape, so the same prompt
prefilled in other chunks gives logits about 1 ulp apart (measured 2026-12-06 on a tiny model:
token budgets 16 and 7 against 4,096). Greedy tokens flip only at a near tie, but G18's
bit-identity is the native CPU backend's (``cpu_paged.py``, the default on CPU), not this
reference's, which serves where nothing faster runs (``--no-native-kernels``, float16 on CPU, no
C compiler) and as the oracle the kernels are checked against.

CUDA graphs (``supports_cuda_graphs`` True; the runner captures, ``model/cuda_graphs.py``).
``init_cuda_graph_state`` allocates, once, the buffers a captured decode step reads: block
tables ``[max_num_seqs, max_num_blocks_per_seq]``, sequence lengths and slot mapping.
``prepare_for_capture(n)`` switches ``forward`` to graph mode over their first ``n`` rows:
it then reads nothing but those buffers and the cache (no Python lists, no per-step
tensors), so every shape is fixed by ``n`` and the buffers' width: each row gathers its
whole block-table row (``max_num_blocks_per_seq`` blocks) and masks positions at or past
its length. ``prepare_for_replay(meta)`` copies a step (already padded by the runner to
the captured size) into the buffers in place; ``prepare`` (an eager step) leaves graph
mode. The cost of fixed shapes: a graphed decode reads ``max_model_len`` positions per
row and layer whatever the real lengths, where the eager path reads the batch's longest.
That is right for a reference (and for short contexts) but not fast at long ones; a
backend whose kernel reads only ``seq_len`` positions from the same kind of buffers
(Triton's decode grid is one work item per sequence; FlashInfer's wrappers with
``use_cuda_graph=True``) is where graphs should pay off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from refengine.kernels.attention.base import AttentionBackend, AttentionMetadata
from refengine.kernels.attention.graph_buffers import CapturableBackend, DecodeGraphBuffers, graph_device
from refengine.kernels.attention.sdpa import chunk_attention, context_mask


@dataclass
class _PrefillPlan:
    query_rows: slice
    block_ids: torch.Tensor  # [num_blocks] the sequence's blocks, in order
    seq_len: int
    mask: torch.Tensor | None  # [query_len, seq_len] bool, True = attend; None = plain causal


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


class TorchReferenceBackend(CapturableBackend, AttentionBackend):
    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._decodes: list[_DecodePlan] = []
        self._prefills: list[_PrefillPlan] = []
        self._graph: DecodeGraphBuffers | None = None

    def init_cuda_graph_state(self, max_num_seqs: int, max_num_blocks_per_seq: int,
                              device: torch.device | str | None = None) -> None:
        """The graph buffers, on ``device`` (None: the current CUDA device; the CPU only in
        tests, which run graph mode eagerly). Safe placeholder values: block 0, length 1."""
        self._graph = DecodeGraphBuffers.allocate(max_num_seqs, max_num_blocks_per_seq, graph_device(device),
                                                  torch.int64)

    def prepare_for_replay(self, meta: AttentionMetadata) -> None:
        """Copy a decode step (padded to a captured size by the caller) into the buffers'
        first rows in place; block-table columns past ``meta``'s width become block 0 (masked)."""
        assert self._graph is not None, "init_cuda_graph_state() must run before prepare_for_replay()"
        self._graph.load(meta)

    def prepare(self, meta: AttentionMetadata) -> None:
        self._graph_rows = None
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
            mask = context_mask(seq_len, query_len)
            mask = None if mask is None else mask.to(meta.block_tables.device)
            rows = slice(meta.query_start_loc[i], meta.query_start_loc[i + 1])
            self._prefills.append(_PrefillPlan(rows, meta.block_tables[i, :num_blocks], seq_len, mask))
        self._decodes = [self._plan_decodes(meta, group) for group in _length_groups(meta, decode_seqs)]

    @staticmethod
    def _plan_decodes(meta: AttentionMetadata, seqs: list[int]) -> _DecodePlan:
        # The plan's tensors live where the step's are (the runner moves the block tables to the
        # model's device): a CPU mask against CUDA keys fails.
        device = meta.block_tables.device
        lengths = [meta.seq_lens[i] for i in seqs]
        seq_lens = torch.tensor(lengths, device=device)
        num_blocks = -(-max(lengths) // meta.block_size)
        block_ids = meta.block_tables[seqs][:, :num_blocks].reshape(-1)
        positions = torch.arange(num_blocks * meta.block_size, device=device)
        mask = (positions.unsqueeze(0) < seq_lens.unsqueeze(1))[:, None, None, :]
        all_rows = seqs == list(range(meta.num_seqs))
        rows = None if all_rows else torch.tensor([meta.query_start_loc[i] for i in seqs], device=device)
        return _DecodePlan(rows, block_ids, mask)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        if self._graph_rows is not None:
            return self._graph_forward(q, k, v, k_cache, v_cache, scale)
        assert self._meta is not None, "prepare() must run before forward()"
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        k_flat.index_copy_(0, self._meta.slot_mapping, k.to(k_cache.dtype))
        v_flat.index_copy_(0, self._meta.slot_mapping, v.to(v_cache.dtype))
        if len(self._decodes) == 1 and self._decodes[0].query_rows is None:  # decode-only: no scatter
            return self._decode_attention(q, k_cache, v_cache, self._decodes[0], scale)
        out = torch.empty_like(q)
        for plan in self._prefills:
            keys = k_cache.index_select(0, plan.block_ids).to(q.dtype).view(-1, num_kv_heads, head_dim)
            values = v_cache.index_select(0, plan.block_ids).to(q.dtype).view(-1, num_kv_heads, head_dim)
            keys, values = keys.transpose(0, 1)[:, : plan.seq_len], values.transpose(0, 1)[:, : plan.seq_len]
            out[plan.query_rows] = chunk_attention(q[plan.query_rows], keys, values, plan.mask, scale)
        for decode in self._decodes:
            out[decode.query_rows] = self._decode_attention(q[decode.query_rows], k_cache, v_cache, decode, scale)
        return out

    def _graph_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """Graph mode: the first ``_graph_rows`` rows of the buffers, one query token each;
        every shape fixed, every index read from the buffers."""
        graph, n = self._graph, self._graph_rows
        assert graph is not None and n is not None and q.shape[0] == n, "graph mode takes the captured batch"
        block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        slots = graph.slot_mapping[:n]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))
        width = graph.block_tables.shape[1] * block_size
        positions = torch.arange(width, device=q.device)
        mask = (positions.unsqueeze(0) < graph.seq_lens[:n].unsqueeze(1))[:, None, None, :]
        plan = _DecodePlan(None, graph.block_tables[:n].reshape(-1), mask)
        return self._decode_attention(q, k_cache, v_cache, plan, scale)

    @staticmethod
    def _decode_attention(q, k_cache, v_cache, plan: _DecodePlan, scale: float) -> torch.Tensor:
        """One padded SDPA call for all decode rows: q [B, H, D] -> [B, H, D]."""
        batch, num_kv_heads, head_dim = q.shape[0], k_cache.shape[2], k_cache.shape[3]
        keys = k_cache.index_select(0, plan.block_ids).to(q.dtype).view(batch, -1, num_kv_heads, head_dim)
        values = v_cache.index_select(0, plan.block_ids).to(q.dtype).view(batch, -1, num_kv_heads, head_dim)
        # Padding positions (past a row's length, or block 0 standing in for absent blocks) hold
        # whatever was written there; a masked NaN would still reach SDPA's products, so they are zeroed.
        padding = ~plan.mask.view(batch, 1, -1, 1)
        keys = keys.transpose(1, 2).masked_fill(padding, 0)
        values = values.transpose(1, 2).masked_fill(padding, 0)
        attn = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=plan.mask, scale=scale, enable_gqa=True
        )
        return attn.squeeze(2)
