"""bf16 projections in the native AVX512-BF16 GEMM (``kernels/cpu/gemm_bf16.c``).

``Linear`` takes this path for bf16 weights on a CPU that has AVX512-BF16 and no AMX; there it
ran SmolLM2's projections 1.06-1.6x as fast as oneDNN's bf16 GEMM at 1 to 2,048 rows
(``benchmarks/cpu_gemm.py``, ``benchmarks/README.md``). With AMX, tile instructions are several
times faster, so ``unavailable_reason`` leaves those CPUs to ``kernels/amx_gemm.py``. Each output
element sums its k pairs in one fixed order, so a row's result does not depend on the other rows
of the call (RULES G18), and no 1-row special case is needed.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from refengine.kernels import cpu, cpu_features

LANES = 16  # output columns per packed panel; n must be a multiple
_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    loaded = cpu.load("gemm_bf16")
    if loaded.library is None:
        return None, loaded.reason
    library = loaded.library
    if not library.gemm_bf16_supported():
        return None, "gemm_bf16.c was built without AVX512-BF16 (the compiler's -march=native lacks it)"
    library.gemm_bf16_pack.argtypes = [_POINTER, _POINTER, _SIZE, _SIZE]
    library.gemm_bf16_pack.restype = None
    library.gemm_bf16.argtypes = [_POINTER, _SIZE, _SIZE, _POINTER, _SIZE, _POINTER, _POINTER]
    library.gemm_bf16.restype = None
    library.gemm_bf16_silu_mul.argtypes = [_POINTER, _SIZE, _SIZE, _POINTER, _SIZE, _POINTER]
    library.gemm_bf16_silu_mul.restype = None
    return library, ""


def unavailable_reason(enabled: bool = True) -> str:
    """"" when bf16 projections run in the native GEMM; else why they do not. ``enabled`` is
    ``KernelConfig.native_cpu_kernels``."""
    if not enabled:
        return cpu.DISABLED.reason
    flags = cpu_features.cpu_flags()
    if "amx_bf16" in flags:
        return "this CPU has AMX-BF16, where the AMX GEMM (kernels/cpu/gemm_amx.c) is faster"
    if "avx512_bf16" not in flags:
        return "this CPU has no avx512_bf16"
    return _library()[1] or _self_check()


@functools.cache
def _self_check() -> str:
    """Once per process: the kernel on random data agrees with ``F.linear`` in float32."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(7 * LANES, 40, generator=generator).bfloat16()
    bias = torch.randn(7 * LANES, generator=generator).bfloat16()
    x = torch.randn(5, 40, generator=generator).bfloat16()
    expected = F.linear(x.float(), weight.float(), bias.float())
    if not torch.allclose(PackedBf16Weight(weight, bias)(x).float(), expected, atol=0.1, rtol=2e-2):
        return "gemm_bf16.c disagreed with F.linear on its self-check"
    return ""


def whole_panels(out_features: int, in_features: int, k_step: int, silu_and_mul: bool) -> bool:
    """Whether a ``[out_features, in_features]`` weight is whole panels of 16 columns and whole k
    steps (with the SiLU epilogue, the gate and up halves must each be whole panels): the shape
    rule of both native GEMMs, which differ only in ``k_step``."""
    panel_columns = 2 * LANES if silu_and_mul else LANES
    return out_features % panel_columns == 0 and in_features % k_step == 0 and in_features > 0


def supports_shape(out_features: int, in_features: int, silu_and_mul: bool = False) -> bool:
    """Whether a ``[out_features, in_features]`` weight fits the kernel (k in pairs)."""
    return whole_panels(out_features, in_features, 2, silu_and_mul)


def alternate_panels(gate_up: torch.Tensor) -> torch.Tensor:
    """The rows of ``[gate | up]`` reordered as gate panel 0, up panel 0, gate panel 1, ...: the
    layout the SiLU epilogues read (``gemm_bf16_silu_mul``, ``gemm_amx_silu_mul``: one tile holds both
    halves of its output columns)."""
    gate, up = gate_up.chunk(2)
    return torch.stack([gate.view(-1, LANES, gate.shape[1]), up.view(-1, LANES, up.shape[1])], dim=1).reshape(
        gate_up.shape)


class PackedBf16Weight:
    """A ``[out_features, in_features]`` bf16 weight packed for ``gemm_bf16``, and its bias in
    float32 (added before the one rounding to bf16). Callable: ``x @ weight.T + bias``.

    With ``silu_and_mul`` the weight is an MLP's ``[gate | up]`` (no bias) and the call returns
    ``silu(x @ gate.T) * (x @ up.T)``, ``[..., out_features / 2]``, from the GEMM's epilogue in one
    pass: within one bf16 step of what ``FusedOps.silu_and_mul`` gives on the plain call's output
    (``gemm_bf16.c`` says why).

    The AMX GEMM (``amx_gemm.PackedAmxWeight``) is this class over another library: a subclass
    names its C functions' prefix (``KERNEL``: ``<KERNEL>``, ``<KERNEL>_pack``,
    ``<KERNEL>_silu_mul``, same signatures), its k step and its loader."""

    KERNEL, K_STEP = "gemm_bf16", 2

    @staticmethod
    def _load() -> tuple[ctypes.CDLL | None, str]:
        return _library()

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, silu_and_mul: bool = False) -> None:
        library, reason = self._load()
        if library is None:
            raise RuntimeError(reason)
        self.out_features, self.in_features = weight.shape
        if (not whole_panels(self.out_features, self.in_features, self.K_STEP, silu_and_mul)
                or weight.dtype != torch.bfloat16):
            columns = "32n" if silu_and_mul else "16n"
            raise ValueError(f"{self.KERNEL} takes bf16 weights of [{columns}, {self.K_STEP}k], not {weight.dtype} "
                             f"{tuple(weight.shape)}")
        if silu_and_mul and bias is not None:
            raise ValueError("the SiLU epilogue takes no bias")
        # Held in a local: the kernel reads its memory.
        weight = (alternate_panels(weight) if silu_and_mul else weight).contiguous()
        self.packed = torch.empty(weight.numel(), dtype=torch.bfloat16)
        getattr(library, self.KERNEL + "_pack")(weight.data_ptr(), self.packed.data_ptr(), self.out_features,
                                                self.in_features)
        self.bias = None if bias is None else bias.float().contiguous()
        self.silu_and_mul = silu_and_mul
        self.out_columns = self.out_features // 2 if silu_and_mul else self.out_features
        self._gemm = getattr(library, self.KERNEL)
        self._gemm_silu_mul = getattr(library, self.KERNEL + "_silu_mul")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # A no-op reshape or .to() still costs a dispatch (~1 us each; a decode step makes ~120
        # calls at batch 1), so the [rows, in_features] bf16 input of the model's calls skips both.
        flat = x.dim() == 2 and x.shape[1] == self.in_features
        rows = x if flat else x.reshape(-1, self.in_features)
        if rows.dtype != torch.bfloat16:
            rows = rows.to(torch.bfloat16)
        rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.out_columns, dtype=torch.bfloat16)
        if rows.shape[0] and self.silu_and_mul:
            self._gemm_silu_mul(rows.data_ptr(), rows.shape[0], self.in_features, self.packed.data_ptr(),
                                self.out_features, out.data_ptr())
        elif rows.shape[0]:
            self._gemm(rows.data_ptr(), rows.shape[0], self.in_features, self.packed.data_ptr(), self.out_features,
                       None if self.bias is None else self.bias.data_ptr(), out.data_ptr())
        return out if flat else out.reshape(*x.shape[:-1], self.out_columns)
