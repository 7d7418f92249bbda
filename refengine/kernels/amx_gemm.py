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
from refengine.kernels.native_gemm import PackedBf16Weight, whole_panels

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
    """Whether a ``[out_features, in_features]`` weight is whole B tiles (16 columns, 32 k)."""
    return whole_panels(out_features, in_features, K_STEP, silu_and_mul)


class PackedAmxWeight(PackedBf16Weight):
    """A ``[out_features, in_features]`` bf16 weight packed into AMX tiles: ``PackedBf16Weight``
    (bias in float32, the SiLU epilogue with ``silu_and_mul``, the same call) over
    ``gemm_amx.c``, whose epilogue has the same arithmetic (``silu_store.h``)."""

    KERNEL, K_STEP = "gemm_amx", K_STEP

    @staticmethod
    def _load() -> tuple[ctypes.CDLL | None, str]:
        return _library()
