"""Dense projections, ``x @ weight.T + bias``, with the weight prepared once.

On CPU in float32 the weight is reordered once into oneDNN's blocked layout and
every call runs oneDNN's GEMM on it (``torch.ops.mkldnn._linear_pointwise``, the
op torch's own compiler emits for frozen CPU linears). ``F.linear`` instead hands
the row-major weight to the BLAS, which re-packs it on every call; on the skinny
products of decode steps that packing costs about as much as the arithmetic. On
the project's 2-core machine, all 120 SmolLM2 layer projections at 32 rows take
42 ms this way against 74 ms with ``F.linear``, and 2.0 s against 2.3 s at 2,048
rows (``benchmarks/README.md``).

The packed op is private torch API, so it is used only after a one-time check on
random data agrees with ``F.linear``; otherwise (other dtypes, GPUs, a torch without
oneDNN, ``prepack=False`` from ``KernelConfig.onednn_linear`` / ``--no-onednn``) the
projection is plain ``F.linear``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from refengine.kernels.forward_context import ForwardContext


@functools.cache
def onednn_available() -> bool:
    """Whether this torch has the packed oneDNN linear ops and they agree with ``F.linear``."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(24, 40, generator=generator)
        bias = torch.randn(24, generator=generator)
        x = torch.randn(3, 40, generator=generator)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return bool(torch.allclose(out, F.linear(x, weight, bias), atol=1e-4, rtol=1e-4))


class Linear:
    """One projection. ``weight`` is ``[out_features, in_features]``; after packing only
    the packed copy is kept, so the model holds each weight once. ``prepack`` is
    ``KernelConfig.onednn_linear``: False keeps the weight as given and uses ``F.linear``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, prepack: bool = True) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = (
            prepack and weight.device.type == "cpu" and weight.dtype == torch.float32 and onednn_available()
        )
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if self.packed else weight

    def __call__(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        """``x @ weight.T + bias``. ``ctx`` carries the step's per-token facts; a plain
        projection needs none of them (``LoraLinear`` reads ``ctx.lora``)."""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
