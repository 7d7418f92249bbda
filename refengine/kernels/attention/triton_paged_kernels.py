"""The Triton kernels of the paged-attention backend (``triton_paged.py`` is their host side:
it prepares a step's index tensors once and launches these once per layer).

* ``store_kv``: grid ``(num_tokens, num_kv_heads)``; a program copies one token's key
  and value row for one KV head (``head_dim`` padded to a power of two, masked) to slot
  ``slot_mapping[t]`` (block ``slot // block_size``, row ``slot % block_size``). A
  negative slot is skipped (room for padded batches).
* ``paged_attention``: grid ``(work items, num_kv_heads * head_chunks, num_splits)``. A
  work item (built in ``prepare``) is ``QUERY_TILE`` consecutive query rows of one
  sequence; a program takes those rows times ``HEADS_TILE`` query heads of one KV head
  (GQA: query head ``h`` reads KV head ``h // group``) and stacks them into one
  ``[BLOCK_M, head_dim]`` tile (row ``m`` = query row ``m // HEADS_TILE``, head
  ``m % HEADS_TILE``; ``BLOCK_M`` is at least the 16 ``tl.dot`` needs, surplus rows are
  masked), so each key/value tile is loaded once for every query head that reads it. It
  walks the sequence's keys ``BLOCK_N`` positions at a time, gathering each position
  through the block table (so tiles need not align with cache blocks and any block size
  works), up to the tile's last query position (causal: query row ``r`` of sequence
  ``i`` sits at ``seq_len_i - query_len_i + r`` and sees positions up to it), with an
  online softmax (running max and sum). ``head_chunks`` is 1 unless a group is wider than
  ``HEADS_TILE`` (wide GQA groups at a 16-row query tile).
* split-KV: the same kernel with ``SPLIT_KV``: split ``s`` covers key positions
  ``[s * partition, (s + 1) * partition)`` and writes its unnormalised output, running
  max and sum to fp32 workspaces; ``combine_splits`` (grid ``(num_tokens, num_heads)``)
  rescales the partials to a common max and divides once. This gives a long decode
  context ``num_splits`` programs per (sequence, KV head) instead of one, so a small
  decode batch still fills the GPU (when to split: ``triton_paged.split_kv_plan``).

Precision: scores, running max/sum and the output accumulate in fp32 (``exp2`` with the
scale folded into ``log2 e``); fp16/bf16 tiles go to the tensor cores as they are (the
probabilities are rounded to the value dtype for ``P @ V``, as flash attention does), fp32
tiles use IEEE fp32 dots, so fp32 matches the torch reference to ~1e-6. The output is
rounded to ``q``'s dtype once. The cache may hold another dtype than ``q``
(``--kv-cache-dtype``): the write kernel converts into it, the attention kernel converts
each tile it loads back to ``q``'s dtype. Under ``TRITON_INTERPRET=1`` bf16 is computed wrongly by
the interpreter (tests use fp32 and fp16).

Invariants relied on: the step's new keys/values are written before any program reads
the cache (two launches on one stream); every position below ``seq_len`` of a sequence is
written (by this step or an earlier one); slots are distinct, so the write kernel needs no
atomics; each output element is written by one program.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the module imports, its kernels are plain functions never launched
    triton = None
    tl = None


def _jit(fn: Callable[..., None]) -> Any:
    """``triton.jit`` when Triton is there; the plain function otherwise (never launched)."""
    return triton.jit(fn) if triton is not None else fn


@_jit
def store_kv(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, block_size,
             stride_kt, stride_kh, stride_vt, stride_vh,
             stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
             HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """Cache row ``slot_mapping[t]`` of KV head ``h`` = ``k[t, h]`` (and ``v``), for one (t, h)."""
    token = tl.program_id(0).to(tl.int64)  # token x row stride may pass 2**31 elements
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    row = slot % block_size
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_d = offs_d < HEAD_DIM
    key = tl.load(k_ptr + token * stride_kt + head * stride_kh + offs_d, mask=mask_d)
    value = tl.load(v_ptr + token * stride_vt + head * stride_vh + offs_d, mask=mask_d)
    key, value = key.to(k_cache_ptr.dtype.element_ty), value.to(v_cache_ptr.dtype.element_ty)  # the cache's dtype
    tl.store(k_cache_ptr + block * stride_kcb + row * stride_kct + head * stride_kch + offs_d, key, mask=mask_d)
    tl.store(v_cache_ptr + block * stride_vcb + row * stride_vct + head * stride_vch + offs_d, value, mask=mask_d)


@_jit
def paged_attention(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
                    block_tables_ptr, query_start_ptr, seq_lens_ptr, work_seq_ptr, work_row_ptr,
                    scale_log2, group, head_chunks, num_heads, num_splits, partition, block_size, stride_bt,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                    QUERY_TILE: tl.constexpr, HEADS_TILE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                    PRECISION: tl.constexpr, SPLIT_KV: tl.constexpr):
    """Causal attention of one work item's query rows x one KV head's query heads (x one split)."""
    seq = tl.load(work_seq_ptr + tl.program_id(0))
    first_row = tl.load(work_row_ptr + tl.program_id(0))
    kv_head = tl.program_id(1) // head_chunks
    head_chunk = tl.program_id(1) % head_chunks
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - query_len

    offs_m = tl.arange(0, BLOCK_M)
    row_in_tile = offs_m // HEADS_TILE
    head_in_group = head_chunk * HEADS_TILE + offs_m % HEADS_TILE
    row = first_row + row_in_tile  # query row within the sequence
    valid_m = (row_in_tile < QUERY_TILE) & (row < query_len) & (head_in_group < group)
    head = kv_head * group + head_in_group
    token = (query_start + row).to(tl.int64)  # rows x strides may pass 2**31 elements (found by review)
    query_pos = context + row
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=valid_m[:, None] & mask_d[None, :], other=0.0)

    kv_end = tl.minimum(seq_len, context + first_row + QUERY_TILE)  # past the tile's last query position
    kv_start = 0
    if SPLIT_KV:
        kv_start = tl.program_id(2) * partition
        kv_end = tl.minimum(kv_end, kv_start + partition)
    running_max = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)  # finite: no inf - inf for masked rows
    running_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM_PAD), dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(kv_start, kv_end, BLOCK_N):
        pos = start + offs_n
        valid_n = pos < kv_end
        page = tl.load(table + pos // block_size, mask=valid_n, other=0).to(tl.int64)
        slot_row = pos % block_size
        k_ptrs = (k_cache_ptr + page[None, :] * stride_kb + slot_row[None, :] * stride_kt + kv_head * stride_kh
                  + offs_d[:, None])
        # [HEAD_DIM_PAD, BLOCK_N], in q's dtype whatever the cache holds (--kv-cache-dtype)
        keys = tl.load(k_ptrs, mask=mask_d[:, None] & valid_n[None, :], other=0.0).to(q.dtype)
        scores = tl.dot(q, keys, input_precision=PRECISION) * scale_log2
        attend = valid_n[None, :] & (pos[None, :] <= query_pos[:, None])
        scores = tl.where(attend, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        alpha = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * alpha + tl.sum(probs, axis=1)
        v_ptrs = (v_cache_ptr + page[:, None] * stride_vb + slot_row[:, None] * stride_vt + kv_head * stride_vh
                  + offs_d[None, :])
        values = tl.load(v_ptrs, mask=valid_n[:, None] & mask_d[None, :], other=0.0).to(q.dtype)  # [BLOCK_N, D_PAD]
        acc = acc * alpha[:, None] + tl.dot(probs.to(values.dtype), values, input_precision=PRECISION)
        running_max = new_max

    if SPLIT_KV:
        part = (token * num_heads + head) * num_splits + tl.program_id(2)
        tl.store(part_max_ptr + part, running_max, mask=valid_m)
        tl.store(part_sum_ptr + part, running_sum, mask=valid_m)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=valid_m[:, None])
    else:
        out = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=valid_m[:, None] & mask_d[None, :])


@_jit
def combine_splits(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, num_heads, num_splits, stride_ot, stride_oh,
                   SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """``out[t, h]``: the splits' partial outputs rescaled to their common max, summed, divided once."""
    token = tl.program_id(0).to(tl.int64)  # token x row stride may pass 2**31 elements
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    mask_s = offs_s < num_splits
    part = (token * num_heads + head) * num_splits + offs_s
    maxes = tl.load(part_max_ptr + part, mask=mask_s, other=-1.0e30)
    sums = tl.load(part_sum_ptr + part, mask=mask_s, other=0.0)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    accs = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], mask=mask_s[:, None], other=0.0)
    weights = tl.exp2(maxes - tl.max(maxes, axis=0))  # an empty split (max -1e30, sum 0) weighs 0
    total = tl.sum(sums * weights, axis=0)
    out = tl.sum(accs * weights[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)
