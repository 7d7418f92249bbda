"""The AMX bf16 GEMM (kernels/cpu/gemm_amx.c through kernels/amx_gemm.py).

Oracle: float64 matmul of the same bf16 inputs, rounded once to bf16. The kernel accumulates in
float32, so it may land one bf16 step (ulp) off that rounding where the float64 sum sits near a
rounding boundary, and where the sum cancels (a result far below its terms) float32's own
rounding of the terms shows: each element may be off by one bf16 step plus 2^-22 of the sum of
its terms' magnitudes, and nearly all must be exact. (Seen: a result of -3.7e-6 from terms whose
magnitudes sum to 15.3 came out 2 bf16 steps off, 4.5e-8, as a float32 sum in another order.)
"""

from __future__ import annotations

import pytest
import torch

from refengine.kernels import amx_gemm, cpu_features, linear
from refengine.kernels.linear import Linear
from tests.unit.gemm_helpers import assert_rows_do_not_depend_on_the_call

pytestmark = pytest.mark.threads(2)  # the work split between threads (tests/conftest.py)


def _why_it_cannot_run() -> str:
    """Why the AMX GEMM cannot run here; not its self-check, which must pass where it can (a
    failing self-check would silently hand every weight to oneDNN)."""
    if "amx_bf16" not in cpu_features.cpu_flags():
        return "this CPU has no amx_bf16"
    return amx_gemm._library()[1]  # noqa: SLF001 - the build and the kernel's AMX grant, apart from the self-check


needs_amx = pytest.mark.skipif(bool(_why_it_cannot_run()),
                               reason=f"the AMX GEMM cannot run here: {_why_it_cannot_run()}")


def _case(rows: int, out_features: int, in_features: int, seed: int = 0, bias: bool = True):
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).bfloat16()
    bias_tensor = torch.randn(out_features, generator=generator).bfloat16() if bias else None
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    return weight, bias_tensor, x


def _assert_close(out: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> None:
    """The oracle of the module docstring."""
    bias64 = torch.zeros(weight.shape[0], dtype=torch.float64) if bias is None else bias.double()
    exact = x.double() @ weight.double().T + bias64
    magnitude = x.double().abs() @ weight.double().abs().T + bias64.abs()
    rounded = exact.to(torch.bfloat16).double()
    step = torch.where(rounded == 0, torch.full_like(rounded, 2.0**-133), rounded.abs() * 2.0**-7)
    error = (out.double() - rounded).abs()
    excess = error - (step + 2.0**-22 * magnitude)
    assert excess.max().item() <= 0, f"off by {error.flatten()[excess.argmax()].item():.3g}"
    assert (error == 0).double().mean().item() >= 0.99


# (rows, out_features, in_features): rows cover both row tiles' tails (blocks of 2 x 16 rows) and
# the 256-row chunks, columns one panel of 16, an odd count of panels and many, k one step of 32 up
# to 1,536.
SHAPES = [(1, 16, 32), (3, 48, 64), (16, 32, 96), (17, 80, 128), (33, 112, 576), (64, 960, 576),
          (9, 576, 1536), (300, 208, 576), (2, 3072, 576)]


@needs_amx
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_matches_the_rounded_float64_product(shape, bias: bool) -> None:
    weight, bias_tensor, x = _case(*shape, bias=bias)
    layer = Linear(weight, bias_tensor)
    assert layer.kind == "amx-bf16"
    out = layer(x)
    assert out.shape == (shape[0], shape[1]) and out.dtype == torch.bfloat16
    _assert_close(out, weight, bias_tensor, x)


@needs_amx
@pytest.mark.parametrize("shape", [(576, 1536), (960, 576), (48, 64)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_rows_do_not_depend_on_the_call(shape) -> None:
    """G18: a row alone, in calls of 1 to 300 rows (every tail of both row tiles, past a 256-row
    chunk), and on 1 or 2 threads gives the same bits."""
    weight, bias, x = _case(300, *shape, seed=3)
    layer = Linear(weight, bias)
    assert layer.kind == "amx-bf16"
    assert_rows_do_not_depend_on_the_call(layer, x, prefixes=[1, 2, 5, 15, 16, 17, 31, 32, 33, 64, 255, 257],
                                          row_step=7)


@needs_amx
def test_calls_keep_their_shape() -> None:
    """Any leading dims, zero rows, and float32 input (cast to bf16 first) as ``F.linear`` gives."""
    weight, bias, x = _case(6, 32, 64)
    layer = Linear(weight, bias)
    assert layer(x.view(2, 3, 64)).shape == (2, 3, 32)
    assert torch.equal(layer(x.view(2, 3, 64)).view(6, 32), layer(x))
    assert layer(x[:0]).shape == (0, 32)
    assert torch.equal(layer(x.float()), layer(x))


@needs_amx
def test_shapes_that_are_not_whole_tiles_take_onednn() -> None:
    """k must be a multiple of 32 and n of 16; otherwise the weight goes to oneDNN (its bf16
    calls of fixed size keep G18)."""
    assert not amx_gemm.supports_shape(32, 40) and not amx_gemm.supports_shape(24, 64)
    weight, bias, x = _case(5, 32, 40)
    layer = Linear(weight, bias)
    assert layer.kind == ("onednn" if linear.onednn_available(torch.bfloat16) else "torch")


def test_off_without_amx_or_native_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``amx_bf16`` in the CPU's flags, or with ``--no-native-kernels``, the AMX GEMM is
    off, says why, and ``bf16_gemm`` names another GEMM."""
    assert amx_gemm.unavailable_reason(enabled=False).startswith("disabled by --no-native-kernels")
    flags = cpu_features.cpu_flags()
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(flags - {"amx_bf16"}))
    assert amx_gemm.unavailable_reason() == "this CPU has no amx_bf16"
    assert "AMX" not in linear.bf16_gemm()
    weight, bias, _ = _case(1, 32, 64)
    assert Linear(weight, bias).kind != "amx-bf16"


@needs_amx
def test_bf16_gemm_names_the_amx_kernel() -> None:
    assert linear.bf16_gemm() == "the native AMX GEMM (kernels/cpu/gemm_amx.c)"
    assert linear.bf16_gemm(native=False).startswith("oneDNN")
