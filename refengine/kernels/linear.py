"""Dense projections, ``x @ weight.T + bias``, with the weight prepared once.

Four kinds, chosen per weight at load (``Linear.kind``):
- ``amx-bf16``: bf16 weights on a CPU with AMX-BF16 run in the project's AMX GEMM
  (``kernels/amx_gemm.py``, ``kernels/cpu/gemm_amx.c``), batch-invariant by construction and
  faster there than oneDNN's bf16 calls of fixed size below; needs
  ``KernelConfig.native_cpu_kernels`` and a shape of [16n, 32k].
- ``native-bf16``: bf16 weights on a CPU with AVX512-BF16 and no AMX run in the project's own
  GEMM (``kernels/native_gemm.py``, ``kernels/cpu/gemm_bf16.c``), faster than oneDNN's there;
  needs ``KernelConfig.native_cpu_kernels`` and a shape of [16n, 2k].
- ``onednn``: otherwise on CPU in float32 (and in bfloat16 where the CPU has native bf16 dot
  products, ``cpu_features.native_bf16``) the weight is reordered once into oneDNN's blocked
  layout and every call runs oneDNN's GEMM on it (``torch.ops.mkldnn._linear_pointwise``, the
op torch's own compiler emits for frozen CPU linears). ``F.linear`` instead hands
the row-major weight to the BLAS, which re-packs it on every call; on the skinny
products of decode steps that packing costs about as much as the arithmetic. On
the project's 2-core machine, all 120 SmolLM2 layer projections at 32 rows take
42 ms this way against 74 ms with ``F.linear``, and 2.0 s against 2.3 s at 2,048
rows (``benchmarks/README.md``).
- ``torch``: ``F.linear`` on the weight as given (GPUs, other dtypes, ``--no-onednn``).

Batch invariance (G18): a row's result must not depend on how many rows share the call.
oneDNN picks its GEMM kernel, and with it the rounding of the reduction over K, by the row count:
- in float32, one kernel for every count of 2 or more and another for a single row (seen at
  down_proj's K = 1,536 on SmolLM2 on an AMD Zen 4, up to 4.5e-6 apart, enough to flip a greedy
  near-tie between a lone decode row and the same row in a batch). So a 1-row float32 call runs
  as two (the row twice) and keeps the first: a 1-row GEMM costs its weight read, which stays.
- in bfloat16, on AMX (an Intel Xeon with AVX10.1 and AMX, 2026-12-05), the kernel changes over
  whole ranges of counts, with or without threads (at gate_up 3,072x576, every count from 5 to 32
  differed from 512). So every oneDNN bf16 call (a weight neither native GEMM takes, or
  ``--no-native-kernels``) runs in calls of exactly ``BF16_CALL_ROWS`` rows, the
  last one padded with zeros: one count, one kernel, and a row's bits do not depend on its
  neighbours or its place in the call (tested). It costs the padding and the extra calls: over
  SmolLM2's projections, 1.8x the time of one call at 1 row, 1.15x at 64, 2.2x at 2,048
  (``benchmarks/cpu_gemm.py``). 64 rather than 32: end to end (``benchmarks/cpu_bf16.py``, the
  mixed 64-request workload) bf16 ran at 1.63-1.65x float32 with 64-row calls against 1.48-1.50x
  with 32, its prefill steps 16 % faster and a 64-row decode step 23 % faster, at the price of
  a 1-row decode step 27 % slower (``benchmarks/README.md``).

The packed op is private torch API, so it is used only after a one-time check on
random data agrees with ``F.linear``; otherwise (other dtypes, GPUs, a torch without
oneDNN, ``prepack=False`` from ``KernelConfig.onednn_linear`` / ``--no-onednn``) the
projection is plain ``F.linear``. The native GEMMs pass self-checks of their own.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from refengine.kernels import amx_gemm, cpu_features, native_gemm
from refengine.kernels.cpu_features import native_bf16
from refengine.kernels.forward_context import ForwardContext

#: Dtypes whose weights may be prepacked: float32 always, bfloat16 where the CPU has native bf16
#: dot products (elsewhere oneDNN emulates them, slower than ``F.linear``'s own path).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
#: Rows of every oneDNN bf16 GEMM call (see the module docstring: G18).
BF16_CALL_ROWS = 64


@functools.cache
def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch has the packed oneDNN linear ops for ``dtype`` and they agree with
    ``F.linear`` (in ``dtype``'s precision)."""
    if dtype not in TOLERANCE or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not native_bf16():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(24, 40, generator=generator).to(dtype)
        bias = torch.randn(24, generator=generator).to(dtype)
        x = torch.randn(3, 40, generator=generator).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    expected = F.linear(x.float(), weight.float(), bias.float())
    return bool(torch.allclose(out.float(), expected, atol=TOLERANCE[dtype] * 10, rtol=TOLERANCE[dtype]))


def bf16_gemm(native: bool = True) -> str:
    """Which GEMM runs bf16 projections on this CPU, for start-up logs and ServerInfo;
    ``native`` is ``KernelConfig.native_cpu_kernels``."""
    amx_reason = amx_gemm.unavailable_reason(native)
    if not amx_reason:
        return "the native AMX GEMM (kernels/cpu/gemm_amx.c)"
    if "amx_bf16" in cpu_features.cpu_flags():  # the AVX512-BF16 GEMM stands aside for AMX: say why AMX's does not run
        return f"oneDNN ({amx_reason})"
    reason = native_gemm.unavailable_reason(native)
    return "the native AVX512-BF16 GEMM (kernels/cpu/gemm_bf16.c)" if not reason else f"oneDNN ({reason})"


class Linear:
    """One projection. ``weight`` is ``[out_features, in_features]``; after packing only
    the packed copy is kept, so the model holds each weight once. ``prepack`` is
    ``KernelConfig.onednn_linear``: False keeps the weight as given and uses ``F.linear``
    (unless the native bf16 GEMM takes it); ``native`` is ``KernelConfig.native_cpu_kernels``.

    ``silu_and_mul`` offers an MLP's ``[gate | up]`` weight the native GEMMs' SiLU epilogue; where
    that kind takes the weight, ``applies_silu_and_mul`` is True and a call returns
    ``silu(gate) * up`` (``[..., out_features / 2]``), else it returns ``[gate | up]`` as usual."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, prepack: bool = True,
                 native: bool = True, silu_and_mul: bool = False) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        on_cpu = weight.device.type == "cpu"
        self.applies_silu_and_mul = False
        if (on_cpu and weight.dtype == torch.bfloat16 and amx_gemm.supports_shape(*weight.shape)
                and not amx_gemm.unavailable_reason(native)):
            self.kind = "amx-bf16"
            self.applies_silu_and_mul = (silu_and_mul and bias is None
                                         and amx_gemm.supports_shape(*weight.shape, silu_and_mul=True))
            self.weight = amx_gemm.PackedAmxWeight(weight, bias, self.applies_silu_and_mul)
        elif (on_cpu and weight.dtype == torch.bfloat16 and native_gemm.supports_shape(*weight.shape)
                and not native_gemm.unavailable_reason(native)):
            self.kind = "native-bf16"
            self.applies_silu_and_mul = (silu_and_mul and bias is None
                                         and native_gemm.supports_shape(*weight.shape, silu_and_mul=True))
            self.weight = native_gemm.PackedBf16Weight(weight, bias, self.applies_silu_and_mul)
        elif prepack and on_cpu and onednn_available(weight.dtype):
            self.kind = "onednn"
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        else:
            self.kind = "torch"
            self.weight = weight

    def __call__(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        """``x @ weight.T + bias``. ``ctx`` carries the step's per-token facts; a plain
        projection needs none of them (``LoraLinear`` reads ``ctx.lora``)."""
        if self.kind in ("amx-bf16", "native-bf16"):
            return self.weight(x)
        if self.kind == "onednn":
            if x.dtype == torch.bfloat16:
                return self._onednn_in_fixed_calls(x)
            if x.dim() == 2 and x.shape[0] == 1:  # see the module docstring (G18)
                return self._onednn(x.expand(2, -1))[:1]
            return self._onednn(x)
        return F.linear(x, self.weight, self.bias)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def _onednn_in_fixed_calls(self, x: torch.Tensor) -> torch.Tensor:
        """``x``'s rows in calls of exactly ``BF16_CALL_ROWS`` rows (G18, module docstring)."""
        rows = x.reshape(-1, self.in_features)
        count = rows.shape[0]
        padded = max(1, -(-count // BF16_CALL_ROWS)) * BF16_CALL_ROWS
        if padded != count:
            rows = F.pad(rows, (0, 0, 0, padded - count))
        outputs = [self._onednn(rows[start:start + BF16_CALL_ROWS]) for start in range(0, padded, BF16_CALL_ROWS)]
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        return out[:count].reshape(*x.shape[:-1], self.out_features)
