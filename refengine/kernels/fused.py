"""Fused elementwise steps of a decoder layer, with torch fallbacks.

float32 and bfloat16 tensors on CPU go through ``kernels/cpu/fused_ops.c`` (one pass, one
call; in bfloat16 it rounds where the torch form rounds);
CUDA tensors (fp32, fp16, bf16) through the Triton kernels of ``kernels/triton_ops.py``
when Triton imports; anything else, a machine without a C compiler (or, on CUDA, without
Triton), or ``FusedOps(native=False)`` takes the torch expressions below, which define
the semantics. ``KernelConfig.native_cpu_kernels`` is that one switch for both: off, no
C library is built and no Triton kernel launched. The kernels are checked against the
torch forms in ``tests/unit/test_fused_ops.py`` and ``tests/unit/test_triton_ops.py``.

The model holds one ``FusedOps``; the module-level functions are the methods of
``FusedOps(native=True)``, kept for callers that have no config at hand.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from refengine.kernels import cpu, triton_ops


@functools.cache
def _library() -> ctypes.CDLL | None:
    return cpu.load("fused_ops").library


@dataclass(frozen=True)
class _Kernels:
    """The C entry points for one dtype (``kernels/cpu/fused_ops.c``)."""

    add_rms_norm: Callable[..., None]
    silu_and_mul: Callable[..., None]
    rotary: Callable[..., int]


_SIGNATURES = {
    "add_rms_norm": [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int, ctypes.c_float],
    "silu_and_mul": [ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_int],
    "rotary": [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64],
}
_RESTYPES = {"rotary": ctypes.c_int}  # -1: a position outside the tables, x untouched
# The library's dtypes: float32, and bfloat16 (bits in uint16, rounded where the torch form rounds).
_SUFFIXES = {torch.float32: "", torch.bfloat16: "_bf16"}


@functools.cache
def _kernels(dtype: torch.dtype) -> _Kernels | None:
    library = _library()
    if library is None or dtype not in _SUFFIXES:
        return None
    functions = {}
    for name, argtypes in _SIGNATURES.items():
        function = getattr(library, name + _SUFFIXES[dtype])
        function.argtypes, function.restype = argtypes, _RESTYPES.get(name)
        functions[name] = function
    return _Kernels(**functions)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize in float32, scale in the model dtype (as the Hugging Face reference does).
    The torch definition, on every path; ``FusedOps.rms_norm`` may take the kernel."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class FusedOps:
    """The fused steps, on the native kernels when ``native`` and the tensors fit (the
    Triton kernels for CUDA tensors; the C library, when it builds, for float32 or bfloat16
    on CPU in the layouts below); else the torch forms."""

    def __init__(self, native: bool = True) -> None:
        self.native = native

    def _triton(self, *tensors: torch.Tensor) -> bool:
        """Whether these tensors take the Triton kernels (CUDA, Triton there, ``native`` on)."""
        return self.native and triton_ops.handles(*tensors)

    def _kernel(self, *tensors: torch.Tensor) -> _Kernels | None:
        """The C kernels when ``native`` and the tensors are CPU tensors of one dtype the
        library has (float32, bfloat16)."""
        dtype = tensors[0].dtype
        if self.native and all(t.dtype == dtype and t.is_cpu for t in tensors):
            return _kernels(dtype)
        return None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``rms_norm(x) * weight`` for ``x`` ``[T, hidden]``; ``x`` is left unchanged."""
        return self.add_rms_norm(x, None, weight, eps)

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``residual += delta`` in place (the residual stream), then return
        ``rms_norm(residual) * weight``. The C kernel takes ``residual`` contiguous
        ``[T, hidden]``, ``delta`` of its shape and ``weight`` contiguous ``[hidden]`` (it reads
        them as such: anything else runs the torch form); Triton takes any layout."""
        operands = (residual, weight) if delta is None else (residual, delta, weight)
        if self._triton(*operands):
            return triton_ops.add_rms_norm(residual, delta, weight, eps)
        library = self._kernel(*operands)
        shape = residual.shape  # read once: each read of a shape costs ~0.1 us, and this runs twice a layer
        if (library is None or len(shape) != 2 or not residual.is_contiguous() or not weight.is_contiguous()
                or weight.shape != (shape[1],) or (delta is not None and delta.shape != shape)):
            if delta is not None:
                residual.add_(delta)
            return rms_norm(residual, weight, eps)
        delta = None if delta is None else delta.contiguous()
        out = torch.empty_like(residual)
        library.add_rms_norm(residual.data_ptr(), None if delta is None else delta.data_ptr(), out.data_ptr(),
                             weight.data_ptr(), shape[0], shape[1], eps)
        return out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up = [gate | up]`` ``[T, 2 * inter]`` (the C kernel takes it
        contiguous and 2-D; other shapes run the torch form)."""
        if self._triton(gate_up):
            return triton_ops.silu_and_mul(gate_up)
        library = self._kernel(gate_up)
        shape = gate_up.shape
        if library is None or len(shape) != 2 or shape[1] % 2 or not gate_up.is_contiguous():
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate) * up
        rows, inter = shape[0], shape[1] // 2
        out = torch.empty((rows, inter), dtype=gate_up.dtype)
        library.silu_and_mul(gate_up.data_ptr(), out.data_ptr(), rows, inter)
        return out

    def rotary_(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
        """Rotate ``x`` ``[T, heads, D]`` in place (rotate-half layout). ``cos`` and
        ``signed_sin`` ``[max_positions, D]`` hold ``cos`` and ``[-sin_low, sin_high]``, so
        the rotation is ``x * cos + roll(x, D / 2) * signed_sin``. Rows of ``x`` may be
        strided (a view into the fused QKV output); heads within a row are contiguous
        (for the C kernel, with int64 ``positions`` ``[T]``, contiguous tables and an even D;
        Triton takes any strides). Positions outside the tables raise IndexError on the CPU paths."""
        if self._triton(x, cos, signed_sin):
            triton_ops.rotary_(x, positions, cos, signed_sin)
            return
        library = self._kernel(x, cos, signed_sin)
        rows, heads, head_dim = x.shape
        # What the kernel assumes, each shape and stride read once (~0.1 us a read, on every layer).
        strides, table_shape = x.stride(), cos.shape
        if (library is not None and strides[2] == 1 and strides[1] == head_dim and head_dim % 2 == 0
                and positions.dtype == torch.int64 and positions.shape == (rows,) and len(table_shape) == 2
                and table_shape[1] == head_dim and signed_sin.shape == table_shape and cos.is_contiguous()
                and signed_sin.is_contiguous()):
            positions = positions.contiguous()  # held in a local: the kernel reads its memory
            # The kernel refuses (-1, x untouched) a position outside the tables: the torch form below raises.
            if library.rotary(x.data_ptr(), positions.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(), rows, heads,
                              head_dim, strides[0], table_shape[0]) == 0:
                return
        rotated = torch.addcmul(x * cos[positions].unsqueeze(1), x.roll(head_dim // 2, dims=-1),
                                signed_sin[positions].unsqueeze(1))
        x.copy_(rotated)


_NATIVE_OPS = FusedOps(native=True)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``FusedOps(native=True).add_rms_norm``."""
    return _NATIVE_OPS.add_rms_norm(residual, delta, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``FusedOps(native=True).silu_and_mul``."""
    return _NATIVE_OPS.silu_and_mul(gate_up)


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """``FusedOps(native=True).rotary_``."""
    _NATIVE_OPS.rotary_(x, positions, cos, signed_sin)
