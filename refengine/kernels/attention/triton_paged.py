"""The Triton attention backend (CUDA): paged attention over the default cache layout
``[num_blocks, block_size, num_kv_heads, head_dim]``, one launch per layer for a whole
step (prefill chunks with or without cached context and decode rows together).

Kernels.

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
  decode batch still fills the GPU. Heuristic (``split_kv_plan``): a decode-only step
  whose longest context exceeds ``SPLIT_KV_MIN_BLOCKS`` cache blocks, with
  ``num_splits = min(MAX_KV_SPLITS, ceil(longest / partition_tokens))``; the constructor
  can force it on (any step; tests) or off.

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
atomics; each output element is written by one program. ``prepare`` uploads the step's
int32 index tensors (query starts, lengths, block tables, slots, work list) once, so
``forward`` (once per layer) only launches kernels.

CUDA graphs (decode steps, ``model/cuda_graphs.py``): graph mode reads the fixed buffers of
``triton_graph_buffers.py`` instead of ``prepare``'s tensors, and its launch shapes are those of
an eager decode-only step of the same batch (one query row per work item), so a replayed row
computes what the eager step computes, bit for bit. The one difference would be split-KV, whose
grid depends on the step's longest context: graphs are captured unsplit, and a step that the
eager path would split runs eagerly (``graph_step_ineligible_reason``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from refengine.kernels.attention.base import AttentionBackend, AttentionMetadata
from refengine.kernels.attention.graph_buffers import graph_device
from refengine.kernels.attention.triton_graph_buffers import TritonGraphBuffers

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the module still imports, triton_available() is False
    triton = None
    tl = None

_NO_TABLES = torch.empty(0, dtype=torch.int64)  # split_kv_plan reads lengths only (graph_step_ineligible_reason)
SPLIT_KV_MIN_BLOCKS = 64  # a decode-only step splits when its longest context exceeds this many cache blocks
PARTITION_TOKENS = 512  # the key positions one split covers, at least (rounded up to whole KV tiles)
MAX_KV_SPLITS = 16
MAX_QUERY_TILE = 16  # query rows of one sequence per program in a step with prefill chunks
MAX_ROWS = 128  # query rows x heads stacked in one program's tile, at most
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def triton_available() -> bool:
    """True when Triton can be imported (callers still choose CUDA tensors for it)."""
    return triton is not None


#: The oldest torch and Triton these kernels are written for (the GPU machines' image: torch 2.11, Triton 3.6).
MIN_VERSIONS = {"torch": (2, 11), "triton": (3, 6)}


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2] if part.isdigit())


def stack_too_old() -> str:
    """What is too old in this torch/Triton pair for the kernels; "" when both are new enough."""
    found = {"torch": torch.__version__, "triton": triton.__version__ if triton is not None else "0"}
    old = [f"{name} {found[name]} (needs >= {'.'.join(map(str, need))})" for name, need in MIN_VERSIONS.items()
           if _version(found[name]) < need]
    return f"too old: {', '.join(old)}" if old else ""


def unavailable_reason(dtype: torch.dtype, device: str) -> str:
    """Why this backend cannot run for ``dtype`` on ``device``; "" when it can."""
    if torch.device(device).type != "cuda":
        return f"it needs CUDA, not {device} (Triton kernels run on the CPU only under TRITON_INTERPRET=1, for tests)"
    if not triton_available():
        return "triton is not installed"
    if old := stack_too_old():
        return old
    if not torch.cuda.is_available():
        return "CUDA is not available on this machine"
    if dtype not in DTYPES:
        return f"it needs float16, bfloat16 or float32, not {dtype}"
    return ""


def _jit(fn: Callable[..., None]) -> Any:
    """``triton.jit`` when Triton is there; the plain function otherwise (never launched)."""
    return triton.jit(fn) if triton is not None else fn


@_jit
def store_kv(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, block_size,
             stride_kt, stride_kh, stride_vt, stride_vh,
             stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
             HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """Cache row ``slot_mapping[t]`` of KV head ``h`` = ``k[t, h]`` (and ``v``), for one (t, h)."""
    token = tl.program_id(0)
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
    token = query_start + row
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
    token = tl.program_id(0)
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


# ----------------------------------------------------------------------------- host side


def split_kv_plan(meta: AttentionMetadata, partition_tokens: int = PARTITION_TOKENS,
                  force: bool | None = None) -> tuple[int, int]:
    """``(num_splits, partition)`` for the step: ``(1, 0)`` = no split. Splits a decode-only
    step whose longest context exceeds ``SPLIT_KV_MIN_BLOCKS`` blocks (``force`` True: any
    step; False: never) into at most ``MAX_KV_SPLITS`` partitions of at least
    ``partition_tokens`` positions, rounded up to a multiple of 64 (whole KV tiles)."""
    longest = max(meta.seq_lens, default=0)
    decode_only = all(meta.query_len(i) == 1 for i in range(meta.num_seqs))
    wanted = decode_only and -(-longest // meta.block_size) > SPLIT_KV_MIN_BLOCKS if force is None else force
    num_splits = min(MAX_KV_SPLITS, -(-longest // partition_tokens)) if wanted else 1
    if num_splits <= 1:
        return 1, 0
    partition = -(-longest // num_splits)
    partition = -(-partition // 64) * 64
    return -(-longest // partition), partition


@dataclass(frozen=True)
class _Step:
    """The per-step device tensors (int32) and launch shapes ``prepare`` derives once."""

    query_start_loc: torch.Tensor  # [num_seqs + 1]
    seq_lens: torch.Tensor  # [num_seqs]
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks]
    slot_mapping: torch.Tensor  # [num_tokens] int64, as given
    work_seq: torch.Tensor  # [num_work] the sequence of each work item
    work_row: torch.Tensor  # [num_work] its first query row within the sequence
    query_tile: int
    block_size: int
    num_splits: int
    partition: int


class TritonPagedBackend(AttentionBackend):
    """Paged attention in Triton (see the module docstring). ``split_kv``: None = the
    heuristic, True/False = always/never split; ``partition_tokens``: the split size floor."""

    def __init__(self, split_kv: bool | None = None, partition_tokens: int = PARTITION_TOKENS) -> None:
        if triton is None:
            raise RuntimeError("TritonPagedBackend needs Triton; use the torch reference backend without it")
        self.split_kv = split_kv
        self.partition_tokens = partition_tokens
        self._step: _Step | None = None
        self._graph: TritonGraphBuffers | None = None
        self._graph_rows: int | None = None  # graph mode: forward reads the first rows of ``_graph``

    @property
    def supports_cuda_graphs(self) -> bool:
        return True

    def init_cuda_graph_state(self, max_num_seqs: int, max_num_blocks_per_seq: int,
                              device: torch.device | str | None = None) -> None:
        """The graph buffers, on ``device`` (None: the current CUDA device; the CPU only in tests,
        under the interpreter, which run graph mode eagerly)."""
        self._graph = TritonGraphBuffers.allocate(max_num_seqs, max_num_blocks_per_seq, graph_device(device))

    def prepare_for_capture(self, num_seqs: int) -> None:
        assert self._graph is not None, "init_cuda_graph_state() must run before prepare_for_capture()"
        assert 1 <= num_seqs <= self._graph.seq_lens.numel(), f"{num_seqs} rows do not fit the graph buffers"
        self._graph_rows = num_seqs

    def prepare_for_replay(self, meta: AttentionMetadata) -> None:
        assert self._graph is not None, "init_cuda_graph_state() must run before prepare_for_replay()"
        self._graph.load(meta)

    def graph_step_ineligible_reason(self, seq_lens: list[int], block_size: int) -> str:
        decode = AttentionMetadata(list(range(len(seq_lens) + 1)), list(seq_lens), _NO_TABLES, _NO_TABLES, block_size)
        if split_kv_plan(decode, self.partition_tokens, self.split_kv)[0] > 1:
            return "the eager step would split the KV (graphs are captured unsplit)"
        return ""

    def _graph_step(self, block_size: int) -> _Step:
        """Graph mode's step: the buffers' first rows, the launch shapes of an unsplit decode step."""
        graph, n = self._graph, self._graph_rows
        assert graph is not None and n is not None
        return _Step(query_start_loc=graph.query_start_loc[: n + 1], seq_lens=graph.seq_lens[:n],
                     block_tables=graph.block_tables[:n], slot_mapping=graph.slot_mapping[:n],
                     work_seq=graph.work_seq[:n], work_row=graph.work_row[:n], query_tile=1,
                     block_size=block_size, num_splits=1, partition=0)

    @property
    def num_splits(self) -> int:
        """The prepared step's number of KV splits (1 = no split-KV)."""
        assert self._step is not None, "prepare() must run first"
        return self._step.num_splits

    def prepare(self, meta: AttentionMetadata) -> None:
        self._graph_rows = None
        device = meta.block_tables.device
        query_lens = [meta.query_len(i) for i in range(meta.num_seqs)]
        num_splits, partition = split_kv_plan(meta, self.partition_tokens, self.split_kv)
        longest_query = max(query_lens, default=1)
        query_tile = 1 if longest_query == 1 else min(MAX_QUERY_TILE, triton.next_power_of_2(longest_query))
        work = [(i, row) for i, n in enumerate(query_lens) for row in range(0, n, query_tile)]
        work_table = torch.tensor(work, dtype=torch.int32).reshape(-1, 2).t().contiguous().to(device)
        self._step = _Step(
            query_start_loc=torch.tensor(meta.query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(meta.seq_lens, dtype=torch.int32, device=device),
            block_tables=meta.block_tables.to(torch.int32).contiguous(),
            slot_mapping=meta.slot_mapping,
            work_seq=work_table[0], work_row=work_table[1],
            query_tile=query_tile, block_size=meta.block_size, num_splits=num_splits, partition=partition)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        step = self._step if self._graph_rows is None else self._graph_step(block_size=k_cache.shape[1])
        assert step is not None, "prepare() must run before forward()"
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        assert num_heads % num_kv_heads == 0 and k_cache.shape[3] == head_dim
        assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1, "rows must be contiguous in head_dim"
        head_dim_pad = triton.next_power_of_2(head_dim)
        store_kv[(num_tokens, num_kv_heads)](
            k, v, k_cache, v_cache, step.slot_mapping, step.block_size,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if step.work_seq.numel() == 0:
            return out
        group = num_heads // num_kv_heads
        heads_tile = min(triton.next_power_of_2(group), max(1, MAX_ROWS // step.query_tile))
        head_chunks = -(-group // heads_tile)
        block_m = max(16, step.query_tile * heads_tile)
        block_n = 64 if block_m * head_dim_pad <= 64 * 128 else 32
        splits = step.num_splits
        if splits > 1:
            part_acc = torch.empty(num_tokens * num_heads * splits, head_dim_pad, dtype=torch.float32, device=q.device)
            part_max = torch.empty(num_tokens * num_heads * splits, dtype=torch.float32, device=q.device)
            part_sum = torch.empty_like(part_max)
        else:
            part_acc = part_max = part_sum = out  # not read or written
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        paged_attention[(step.work_seq.numel(), num_kv_heads * head_chunks, splits)](
            q, k_cache, v_cache, out, part_acc, part_max, part_sum,
            step.block_tables, step.query_start_loc, step.seq_lens, step.work_seq, step.work_row,
            scale * math.log2(math.e), group, head_chunks, num_heads, splits, step.partition, step.block_size,
            step.block_tables.stride(0), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            *k_cache.stride()[:3], *v_cache.stride()[:3],
            QUERY_TILE=step.query_tile, HEADS_TILE=heads_tile, BLOCK_M=block_m, BLOCK_N=block_n,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, PRECISION=precision, SPLIT_KV=splits > 1,
            num_warps=4 if block_m <= 64 else 8)
        if splits > 1:
            combine_splits[(num_tokens, num_heads)](
                out, part_acc, part_max, part_sum, num_heads, splits, out.stride(0), out.stride(1),
                SPLITS_PAD=triton.next_power_of_2(splits), HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad)
        return out
