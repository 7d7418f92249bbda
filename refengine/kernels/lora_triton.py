"""Multi-LoRA deltas on CUDA: the Triton twin of ``lora.apply_lora_parts`` (punica / S-LoRA's
SGMV, "segmented gather matrix-vector"), ``y[t] += B[s] @ (A[s] @ x[t])`` for every token
``t`` of a ``LoraBatch`` whose adapter sits in slot ``s``.

Why two kernels. ``A[s]`` is ``[rank, in]`` and ``B[s]`` is ``[out, rank]`` with ``rank``
far below ``in`` and ``out``; multiplying through the rank (shrink, then expand) costs
``rank * (in + out)`` per token instead of the ``in * out`` of a merged ``B @ A``, and the
two halves have opposite shapes (a long reduction to a narrow result, then a short one to
a wide result), so each gets its own tiling:

* ``shrink``: ``shrunk[i] = A[slot] @ x[token_indices[i]]``, reduced over ``in`` in
  ``BLOCK_K`` steps, into a ``[num_lora_tokens, rank]`` fp32 buffer in sorted order;
* ``expand``: ``y[token_indices[i]] += B[slot] @ shrunk[i]``, reduced over ``rank``.

The grid is (segment, row block, column block). A program reads its segment's start,
length and slot from ``batch.seg_tensors`` and covers ``BLOCK_M`` of its rows: one slot
per program, so the adapter's tile is loaded once for all those rows. The grid is sized by
the longest segment; programs past a shorter segment's end return at once, and masks
cover ragged rows, ranks (``rank`` 8 is padded to the 16 that ``tl.dot`` needs) and
columns. Rows of ``x`` are gathered and rows of ``y`` scattered through
``batch.token_indices`` in the kernels, so ``x`` is never copied into sorted order.

Precision: tiles are cast to fp32 after ``tl.load``, products accumulate in fp32, the
shrunk buffer is fp32, and each output element is rounded to ``y``'s dtype once, after
the add (the torch reference rounds the delta first, so low-precision results may differ
in the last bit). With fp16/bf16 inputs and output the dots run on TF32 tensor cores,
exact for those operands (the fp32 shrunk buffer is rounded to TF32, still no coarser
than the fp16/bf16 the reference keeps it in); when ``x``, a weight or ``y`` is fp32 the
kernel concerned uses IEEE fp32 dots, so fp32 matches the reference.

Invariants relied on: ``token_indices`` holds each token at most once (a ``LoraBatch``
invariant), so each element of ``y`` is written by one program and a plain
read-add-write needs no atomics; every tensor is on one CUDA device (or on the CPU under
``TRITON_INTERPRET=1``, which is read when this module is imported); ``lora_a`` is
``[num_slots, rank, in]``, ``lora_b`` is ``[num_slots, out, rank]``; any strides work.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from refengine.kernels.lora import LoraBatch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the module still imports, triton_available() is False
    triton = None
    tl = None

_SegmentTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@functools.cache
def triton_available() -> bool:
    """True when Triton can be imported (callers still choose CUDA tensors for it)."""
    return triton is not None


def _jit(fn: Callable[..., None]) -> Any:
    """``triton.jit`` when Triton is there; the plain function otherwise (never launched)."""
    return triton.jit(fn) if triton is not None else fn


@_jit
def shrink(x_ptr, a_ptr, out_ptr, tok_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
           in_features, rank, stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_om,
           BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
           PRECISION: tl.constexpr):
    """``out[rows] = x[token_indices[rows]] @ lora_a[slot].T`` for one (segment, row block, rank block)."""
    seg = tl.program_id(0)
    length = tl.load(seg_len_ptr + seg)
    first = tl.program_id(1) * BLOCK_M
    if first >= length:
        return
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    offs_m = first + tl.arange(0, BLOCK_M)
    mask_m = offs_m < length
    rows = tl.load(seg_start_ptr + seg) + offs_m
    tokens = tl.load(tok_ptr + rows, mask=mask_m, other=0).to(tl.int64)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :] * stride_xk
    a_ptrs = a_ptr + slot * stride_as + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, in_features, BLOCK_K):
        mask_k = offs_k < in_features - k
        x_tile = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        a_tile = tl.load(a_ptrs, mask=mask_k[:, None] & mask_r[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(x_tile, a_tile, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_r[None, :]
    tl.store(out_ptrs, acc, mask=mask_m[:, None] & mask_r[None, :])


@_jit
def expand(s_ptr, b_ptr, y_ptr, tok_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
           out_features, rank, stride_sm, stride_bs, stride_bn, stride_br, stride_ym, stride_yn,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
           PRECISION: tl.constexpr):
    """``y[token_indices[rows]] += shrunk[rows] @ lora_b[slot].T`` for one (segment, row block, column block)."""
    seg = tl.program_id(0)
    length = tl.load(seg_len_ptr + seg)
    first = tl.program_id(1) * BLOCK_M
    if first >= length:
        return
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    offs_m = first + tl.arange(0, BLOCK_M)
    mask_m = offs_m < length
    rows = tl.load(seg_start_ptr + seg) + offs_m
    tokens = tl.load(tok_ptr + rows, mask=mask_m, other=0).to(tl.int64)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < out_features
    offs_r = tl.arange(0, BLOCK_R)
    s_ptrs = s_ptr + rows[:, None] * stride_sm + offs_r[None, :]
    b_ptrs = b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(0, rank, BLOCK_R):
        mask_r = offs_r < rank - r
        s_tile = tl.load(s_ptrs, mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        b_tile = tl.load(b_ptrs, mask=mask_r[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(s_tile, b_tile, acc, input_precision=PRECISION)
        s_ptrs += BLOCK_R
        b_ptrs += BLOCK_R * stride_br
    y_ptrs = y_ptr + tokens[:, None] * stride_ym + offs_n[None, :] * stride_yn
    mask = mask_m[:, None] & mask_n[None, :]
    total = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32) + acc
    tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)


def _segments(batch: LoraBatch, active_slots: frozenset[int] | None) -> tuple[_SegmentTensors, int] | None:
    """The segments to run and their longest length; None when none is active. Filtering
    happens on the host (one small copy to the device, only when some slot is skipped)."""
    if active_slots is None or active_slots.issuperset(batch.seg_slots):
        return batch.seg_tensors, batch.max_seg_len
    keep = [i for i, slot in enumerate(batch.seg_slots) if slot in active_slots]
    if not keep:
        return None
    columns = (batch.seg_starts, batch.seg_lens, batch.seg_slots)
    table = torch.tensor([[column[i] for i in keep] for column in columns], dtype=torch.int32,
                         device=batch.seg_tensors[0].device)
    starts, lens, slots = table.unbind(0)
    return (starts, lens, slots), max(batch.seg_lens[i] for i in keep)


def _block(size: int, low: int, high: int) -> int:
    """The power of two covering ``size``, clamped to ``[low, high]`` (``tl.dot`` needs ≥ 16)."""
    return max(low, min(high, triton.next_power_of_2(size)))


def _precision(*tensors: torch.Tensor) -> str:
    """IEEE fp32 dots when any of ``tensors`` is fp32 (TF32 would round it), TF32 otherwise: exact for
    fp16/bf16 operands; expand's fp32 ``shrunk`` operand is rounded to TF32 (the module docstring)."""
    return "ieee" if any(t.dtype == torch.float32 for t in tensors) else "tf32"


def apply_lora_triton(y: torch.Tensor, x: torch.Tensor, batch: LoraBatch, lora_a: torch.Tensor,
                      lora_b: torch.Tensor, active_slots: frozenset[int] | None = None) -> None:
    """``y += delta`` in place for one module, as ``lora.apply_lora_parts`` with one part.
    ``x [T, in]``, ``y [T, out]``. ``active_slots``: the slots whose adapter has weights for this
    projection (others are skipped: their delta is zero); None = all."""
    if triton is None:
        raise RuntimeError("apply_lora_triton needs Triton; use lora.apply_lora_parts without it")
    segments = _segments(batch, active_slots)
    if segments is None:
        return
    (starts, lens, slots), max_len = segments
    _, rank, in_features = lora_a.shape
    out_features = lora_b.shape[1]
    assert x.shape[1] == in_features and y.shape[1] == out_features and lora_b.shape[2] == rank
    tokens = batch.token_indices
    shrunk = torch.empty(tokens.shape[0], rank, dtype=torch.float32, device=x.device)
    block_m = _block(max_len, 16, 64)
    block_r = _block(rank, 16, 64)
    rows = triton.cdiv(max_len, block_m)
    shrink[(len(lens), rows, triton.cdiv(rank, block_r))](
        x, lora_a, shrunk, tokens, starts, lens, slots, in_features, rank,
        x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), shrunk.stride(0),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=64, PRECISION=_precision(x, lora_a))
    block_n = 64
    expand[(len(lens), rows, triton.cdiv(out_features, block_n))](
        shrunk, lora_b, y, tokens, starts, lens, slots, out_features, rank,
        shrunk.stride(0), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), y.stride(0), y.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, PRECISION=_precision(lora_b, y))
