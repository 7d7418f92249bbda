"""bf16 projections in the project's AMX GEMM (``kernels/cpu/gemm_amx.c``).

``Linear`` takes this path for bf16 weights on a CPU with AMX-BF16. oneDNN's AMX kernels are as
fast on large calls, but their rounding changes with the row count, so there they must run in
fixed 64-row calls to keep a row's result independent of its batch (RULES G18,
``kernels/linear.py``), and a decode step of a few rows then pays for 64. This kernel's rounding
depends on the row alone, whatever the count, so it needs no padding (``gemm_amx.c`` says why).
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from refengine.kernels import cpu, cpu_features
from refengine.kernels.native_gemm import alternate_panels

COLUMNS, K_STEP = 16, 32  # a weight is [16n, 32k]: whole B tiles (gemm_amx.c)
_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    loaded = cpu.load("gemm_amx")
    if loaded.library is None:
        return None, loaded.reason
    library = loaded.library
    if not library.gemm_amx_supported():
        return None, ("gemm_amx.c was built without AMX (the compiler's -march=native lacks it), or the "
                      "kernel refused this process the AMX state")
    library.gemm_amx_pack.argtypes = [_POINTER, _POINTER, _SIZE, _SIZE]
    library.gemm_amx_pack.restype = None
    library.gemm_amx.argtypes = [_POINTER, _SIZE, _SIZE, _POINTER, _SIZE, _POINTER, _POINTER]
    library.gemm_amx.restype = None
    library.gemm_amx_silu_mul.argtypes = [_POINTER, _SIZE, _SIZE, _POINTER, _SIZE, _POINTER]
    library.gemm_amx_silu_mul.restype = None
    return library, ""


def unavailable_reason(enabled: bool = True) -> str:
    """"" when bf16 projections run in the AMX GEMM; else why they do not. ``enabled`` is
    ``KernelConfig.native_cpu_kernels``."""
    if not enabled:
        return cpu.DISABLED.reason
    if "amx_bf16" not in cpu_features.cpu_flags():
        return "this CPU has no amx_bf16"
    return _library()[1] or _self_check()


@functools.cache
def _self_check() -> str:
    """Once per process: the kernel on random data agrees with ``F.linear`` in float32."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(3 * COLUMNS, 2 * K_STEP, generator=generator).bfloat16()
    bias = torch.randn(3 * COLUMNS, generator=generator).bfloat16()
    x = torch.randn(37, 2 * K_STEP, generator=generator).bfloat16()
    expected = F.linear(x.float(), weight.float(), bias.float())
    if not torch.allclose(PackedAmxWeight(weight, bias)(x).float(), expected, atol=0.1, rtol=2e-2):
        return "gemm_amx.c disagreed with F.linear on its self-check"
    return ""


def supports_shape(out_features: int, in_features: int, silu_and_mul: bool = False) -> bool:
    """Whether a ``[out_features, in_features]`` weight is whole B tiles (with the SiLU epilogue,
    the gate and up halves must each be whole panels)."""
    panel_columns = 2 * COLUMNS if silu_and_mul else COLUMNS
    return out_features % panel_columns == 0 and in_features % K_STEP == 0 and in_features > 0


class PackedAmxWeight:
    """A ``[out_features, in_features]`` bf16 weight packed into AMX tiles, and its bias in
    float32 (added before the one rounding to bf16). Callable: ``x @ weight.T + bias``.

    With ``silu_and_mul`` the weight is an MLP's ``[gate | up]`` (no bias) and the call returns
    ``silu(x @ gate.T) * (x @ up.T)``, ``[..., out_features / 2]``, from the GEMM's epilogue, with
    the arithmetic of ``native_gemm.PackedBf16Weight``'s (``silu_store.h``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, silu_and_mul: bool = False) -> None:
        library, reason = _library()
        if library is None:
            raise RuntimeError(reason)
        self.out_features, self.in_features = weight.shape
        if not supports_shape(self.out_features, self.in_features, silu_and_mul) or weight.dtype != torch.bfloat16:
            columns = "32n" if silu_and_mul else "16n"
            raise ValueError(f"gemm_amx takes bf16 weights of [{columns}, 32k], not {weight.dtype} "
                             f"{tuple(weight.shape)}")
        if silu_and_mul and bias is not None:
            raise ValueError("the SiLU epilogue takes no bias")
        # Held in a local: the kernel reads its memory.
        weight = (alternate_panels(weight) if silu_and_mul else weight).contiguous()
        self.packed = torch.empty(weight.numel(), dtype=torch.bfloat16)
        library.gemm_amx_pack(weight.data_ptr(), self.packed.data_ptr(), self.out_features, self.in_features)
        self.bias = None if bias is None else bias.float().contiguous()
        self.silu_and_mul = silu_and_mul
        self.out_columns = self.out_features // 2 if silu_and_mul else self.out_features
        self._library = library

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # The model's calls pass [rows, in_features] bf16: a no-op reshape or .to() would still
        # cost a dispatch each (~1 us), so they are skipped (as in native_gemm.PackedBf16Weight).
        flat = x.dim() == 2 and x.shape[1] == self.in_features
        rows = x if flat else x.reshape(-1, self.in_features)
        if rows.dtype != torch.bfloat16:
            rows = rows.to(torch.bfloat16)
        rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.out_columns, dtype=torch.bfloat16)
        if rows.shape[0] and self.silu_and_mul:
            self._library.gemm_amx_silu_mul(rows.data_ptr(), rows.shape[0], self.in_features, self.packed.data_ptr(),
                                            self.out_features, out.data_ptr())
        elif rows.shape[0]:
            self._library.gemm_amx(rows.data_ptr(), rows.shape[0], self.in_features, self.packed.data_ptr(),
                                   self.out_features, None if self.bias is None else self.bias.data_ptr(),
                                   out.data_ptr())
        return out if flat else out.reshape(*x.shape[:-1], self.out_columns)
