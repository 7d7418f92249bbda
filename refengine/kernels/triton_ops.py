"""The fused decoder-layer steps on CUDA: Triton twins of ``FusedOps``' torch forms
(``kernels/fused.py``), which define the semantics; ``FusedOps`` sends CUDA tensors here
when Triton imports and ``native`` is on (``KernelConfig.native_cpu_kernels``).

Grids, one program per independent piece of work, no atomics, no cross-program reads:

* ``add_rms_norm``: one program per row, grid ``(T,)``. A row of up to ``MAX_BLOCK``
  elements is held in registers (one read, one write); a wider row is walked in
  ``MAX_BLOCK`` chunks twice, the first pass summing squares, the second recomputing
  ``residual + delta`` from the inputs (never reading back what it wrote) to store it;
* ``silu_and_mul``: grid ``(T, cdiv(inter, BLOCK))``, one program per row and column block;
* ``rotary_``: grid ``(T, cdiv(heads, BLOCK_H))``; a program reads its token's position
  once, loads the two halves of each head (``x1``, ``x2``) and writes
  ``[x1 * cos_lo + x2 * ssin_lo, x2 * cos_hi + x1 * ssin_hi]`` in place: that is the torch
  form's ``x * cos + roll(x, D / 2) * signed_sin``. A head belongs to one program, so the
  in-place update needs no ordering between programs.

Precision: every value is cast to fp32 after ``tl.load``; results are rounded where the
torch form rounds, so fp16 matches it to the last bit up to libm differences: the sum
``residual + delta`` is rounded to the residual's dtype (and stored), the normalized row
to the residual's dtype before the product with ``weight`` (rounded to the promoted
dtype); ``silu(gate)`` is rounded to the model dtype before the product with ``up``;
``x * cos`` to ``x``'s dtype when the tables share it (else the promoted fp32) before the
add. The reduction runs in fp32 (in a different order than torch's: fp32 results agree to
~1e-6 relative). fp32, fp16 and bf16 only (``handles``); the interpreter's bf16 is wrong,
so bf16 is checked on CUDA alone.

Invariants relied on: every tensor is on one CUDA device (or on the CPU under
``TRITON_INTERPRET=1``, read when this module is imported); ``0 <= positions <
cos.shape[0]`` (the model's ``max_positions``; not checked, as the torch form's indexing
would); tables are ``[max_positions, head_dim]``. Any strides work: rows and columns of
the inputs, ``x``'s rows, heads and columns (a view into the fused QKV output), the
tables' and positions' strides are all passed to the kernels; ``residual`` is updated
through a view when it has one with unit column stride, else through a copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the module still imports, triton_available() is False
    triton = None
    tl = None

#: The widest row ``add_rms_norm`` keeps in registers (elements); wider rows take two passes.
MAX_BLOCK = 8192
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def triton_available() -> bool:
    """True when Triton can be imported (callers still choose CUDA tensors for it)."""
    return triton is not None


def handles(*tensors: torch.Tensor) -> bool:
    """True when these kernels take these tensors: Triton imports and each is a CUDA
    tensor of a dtype they compute (fp32, fp16, bf16)."""
    return triton_available() and all(t.is_cuda and t.dtype in _DTYPES for t in tensors)


def _jit(fn: Callable[..., None]) -> Any:
    """``triton.jit`` when Triton is there; the plain function otherwise (never launched)."""
    return triton.jit(fn) if triton is not None else fn


def _need_triton(name: str) -> None:
    if triton is None:
        raise RuntimeError(f"triton_ops.{name} needs Triton; use FusedOps (the torch forms) without it")


@_jit
def _add_rms_norm_kernel(res_ptr, delta_ptr, weight_ptr, out_ptr, hidden, stride_res, stride_delta, stride_out,
                         eps, HAS_DELTA: tl.constexpr, ONE_PASS: tl.constexpr, BLOCK: tl.constexpr):
    """One row: ``residual += delta`` (stored rounded), ``out = weight * round(r * rsqrt(mean(r^2) + eps))``."""
    row = tl.program_id(0).to(tl.int64)
    res_row = res_ptr + row * stride_res
    delta_row = delta_ptr + row * stride_delta
    out_row = out_ptr + row * stride_out
    cols = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = cols < hidden
        r = tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_DELTA:
            r = (r + tl.load(delta_row + cols, mask=mask, other=0.0).to(tl.float32)).to(res_ptr.dtype.element_ty)
            tl.store(res_row + cols, r, mask=mask)
            r = r.to(tl.float32)
        scale = tl.rsqrt(tl.sum(r * r, axis=0) / hidden + eps)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        normed = (r * scale).to(res_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_row + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        squares = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, hidden, BLOCK):
            mask = start + cols < hidden
            r = tl.load(res_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_DELTA:
                d = tl.load(delta_row + start + cols, mask=mask, other=0.0).to(tl.float32)
                r = (r + d).to(res_ptr.dtype.element_ty).to(tl.float32)
            squares += r * r
        scale = tl.rsqrt(tl.sum(squares, axis=0) / hidden + eps)
        for start in range(0, hidden, BLOCK):
            mask = start + cols < hidden
            r = tl.load(res_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_DELTA:
                d = tl.load(delta_row + start + cols, mask=mask, other=0.0).to(tl.float32)
                r = (r + d).to(res_ptr.dtype.element_ty)
                tl.store(res_row + start + cols, r, mask=mask)
                r = r.to(tl.float32)
            w = tl.load(weight_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            normed = (r * scale).to(res_ptr.dtype.element_ty).to(tl.float32)
            tl.store(out_row + start + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@_jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, inter, stride_gu_row, stride_gu_col, stride_out, BLOCK: tl.constexpr):
    """One (row, column block): ``out = round(silu(gate)) * up``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate_ptrs = gu_ptr + row * stride_gu_row + cols * stride_gu_col
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + inter * stride_gu_col, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


@_jit
def _rotary_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, heads, half, stride_xt, stride_xh, stride_xd, stride_pos,
                   stride_cos, stride_cos_d, stride_sin, stride_sin_d, ROUND_PRODUCT: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """One (token, head block), in place: ``x = round(x * cos) + roll(x, half) * signed_sin``."""
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token * stride_pos).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < half
    mask = (offs_h < heads)[:, None] & mask_d[None, :]
    lo = x_ptr + token * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :] * stride_xd
    hi = lo + half * stride_xd
    x1 = tl.load(lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(hi, mask=mask, other=0.0).to(tl.float32)
    cos_row = cos_ptr + pos * stride_cos + offs_d * stride_cos_d
    sin_row = sin_ptr + pos * stride_sin + offs_d * stride_sin_d
    cos_lo = tl.load(cos_row, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    cos_hi = tl.load(cos_row + half * stride_cos_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    sin_lo = tl.load(sin_row, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    sin_hi = tl.load(sin_row + half * stride_sin_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    a1 = x1 * cos_lo
    a2 = x2 * cos_hi
    if ROUND_PRODUCT:
        a1 = a1.to(x_ptr.dtype.element_ty).to(tl.float32)
        a2 = a2.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(lo, (a1 + x2 * sin_lo).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(hi, (a2 + x1 * sin_hi).to(x_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``t`` as ``[rows, t.shape[-1]]`` with unit column stride, and whether that is a view of it."""
    if t.dim() == 2 and t.stride(1) == 1:
        return t, True
    try:
        rows = t.view(-1, t.shape[-1])
        if rows.stride(1) == 1:
            return rows, True
    except RuntimeError:  # no such view: fall through to a copy
        pass
    return t.reshape(-1, t.shape[-1]).contiguous(), False


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``FusedOps.add_rms_norm``: ``residual += delta`` in place (when given), then return
    ``weight * rms_norm(residual)`` in ``promote(weight, residual)``'s dtype."""
    _need_triton("add_rms_norm")
    hidden = residual.shape[-1]
    res, is_view = _rows(residual)
    out = torch.empty(res.shape, dtype=torch.promote_types(weight.dtype, residual.dtype), device=residual.device)
    if res.shape[0] == 0:
        return out.view(residual.shape)
    dlt = res if delta is None else _rows(delta.expand(residual.shape))[0]
    block = min(triton.next_power_of_2(hidden), MAX_BLOCK)
    _add_rms_norm_kernel[(res.shape[0],)](
        res, dlt, weight.contiguous(), out, hidden, res.stride(0), dlt.stride(0), out.stride(0), eps,
        HAS_DELTA=delta is not None, ONE_PASS=hidden <= block, BLOCK=block, num_warps=min(max(block // 256, 1), 8))
    if delta is not None and not is_view:
        residual.copy_(res.view(residual.shape))
    return out.view(residual.shape)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``FusedOps.silu_and_mul``: ``silu(gate) * up`` for ``gate_up = [gate | up]`` ``[..., 2 * inter]``."""
    _need_triton("silu_and_mul")
    inter = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, gate_up.shape[-1])  # a view when strides allow; any strides work below
    out = torch.empty((rows.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] and inter:
        block = min(triton.next_power_of_2(inter), 1024)
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
            rows, out, inter, rows.stride(0), rows.stride(1), out.stride(0), BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], inter)


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """``FusedOps.rotary_``: rotate ``x`` ``[T, heads, D]`` in place (rotate-half layout)
    with rows ``positions`` of the ``[max_positions, D]`` tables ``cos`` and ``signed_sin``."""
    _need_triton("rotary_")
    tokens, heads, head_dim = x.shape
    assert cos.shape[-1] == head_dim and signed_sin.shape[-1] == head_dim and head_dim % 2 == 0
    if tokens == 0 or heads == 0:
        return
    positions = positions.to(x.device)
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(heads), 2048 // block_half))
    # torch rounds ``x * cos`` to its result dtype: x's own when the tables share it, else fp32.
    round_product = x.dtype != torch.float32 and torch.promote_types(x.dtype, cos.dtype) == x.dtype
    _rotary_kernel[(tokens, triton.cdiv(heads, block_h))](
        x, positions, cos, signed_sin, heads, half, x.stride(0), x.stride(1), x.stride(2), positions.stride(0),
        cos.stride(0), cos.stride(1), signed_sin.stride(0), signed_sin.stride(1),
        ROUND_PRODUCT=round_product, BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=4)
