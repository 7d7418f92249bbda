"""The native bf16 GEMM (kernels/cpu/gemm_bf16.c through kernels/native_gemm.py).

Oracle: float64 matmul of the same bf16 inputs, rounded once to bf16. The kernel accumulates in
float32, so it may land one bf16 step (ulp) off that rounding where the float64 sum sits near a
rounding boundary; it must never be further off, and must be exact for nearly all elements.
"""

from __future__ import annotations

import pytest
import torch

from refengine.kernels import cpu_features, linear, native_gemm
from refengine.kernels.linear import Linear
from tests.unit.gemm_helpers import assert_rows_do_not_depend_on_the_call

pytestmark = [pytest.mark.threads(2),  # the work split between threads (tests/conftest.py)
              pytest.mark.skipif(bool(native_gemm.unavailable_reason()),
                                reason=f"native bf16 GEMM not used here: {native_gemm.unavailable_reason()}")]


def _case(rows: int, out_features: int, in_features: int, seed: int = 0, bias: bool = True):
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).bfloat16()
    bias_tensor = torch.randn(out_features, generator=generator).bfloat16() if bias else None
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    return weight, bias_tensor, x


def _ulps(out: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """|out - round_bf16(float64 result)| in bf16 steps at the reference's magnitude."""
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    rounded = exact.to(torch.bfloat16).double()
    step = torch.where(rounded == 0, torch.full_like(rounded, 2.0**-133), rounded.abs() * 2.0**-7)
    return ((out.double() - rounded).abs() / step).floor()


# (rows, out_features, in_features): rows cover every row-tile tail (tiles of 4 rows), columns every
# panel count of a column tile (1-6 panels of 16) and several tiles, k = 2 (one pair) up to 1,536.
SHAPES = [(1, 16, 2), (3, 32, 64), (4, 80, 96), (5, 96, 128), (7, 112, 576), (64, 960, 576), (9, 576, 1536),
          (300, 192, 576), (2, 3072, 576)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_matches_the_rounded_float64_product(shape, bias: bool) -> None:
    weight, bias_tensor, x = _case(*shape, bias=bias)
    layer = Linear(weight, bias_tensor)
    assert layer.kind == "native-bf16"
    out = layer(x)
    assert out.shape == (shape[0], shape[1]) and out.dtype == torch.bfloat16
    ulps = _ulps(out, weight, bias_tensor, x)
    assert ulps.max().item() <= 1, f"{ulps.max().item()} bf16 steps off"
    assert (ulps == 0).float().mean().item() >= 0.99


@pytest.mark.parametrize("shape", [(576, 1536), (960, 576), (112, 64)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_rows_do_not_depend_on_the_call(shape) -> None:
    """G18: a row alone, in a batch of 2, 5 or 64 (every row-tile position), and on 1 or 2
    threads gives the same bits."""
    weight, bias, x = _case(64, *shape, seed=3)
    assert_rows_do_not_depend_on_the_call(Linear(weight, bias), x, (2, 5, 63), 5)


def test_inputs_of_any_layout_and_leading_shape() -> None:
    weight, bias, x = _case(12, 96, 64, seed=4)
    layer = Linear(weight, bias)
    expected = layer(x)
    assert torch.equal(layer(x.reshape(3, 4, 64)), expected.reshape(3, 4, 96))
    wide = torch.zeros(12, 164, dtype=torch.bfloat16)
    wide[:, 50:114] = x
    assert torch.equal(layer(wide[:, 50:114]), expected)  # a column slice: rows of stride 164
    assert layer(x[:0]).shape == (0, 96)


def test_a_nan_stays_in_its_row() -> None:
    weight, bias, x = _case(6, 48, 32, seed=5)
    x[2, 7] = float("nan")
    out = Linear(weight, bias)(x)
    assert out[2].isnan().all()
    assert not out[[0, 1, 3, 4, 5]].isnan().any()


@pytest.mark.parametrize("shape", [(40, 64), (48, 63)], ids=["n-not-16n", "k-odd"])
def test_other_shapes_take_onednn_or_torch(shape) -> None:
    weight, bias, x = _case(5, *shape, seed=6)
    layer = Linear(weight, bias)
    assert layer.kind in ("onednn", "torch")
    assert _ulps(layer(x), weight, bias, x).max().item() <= 2


def test_switches_and_cpus_that_do_not_take_it(monkeypatch: pytest.MonkeyPatch) -> None:
    weight, bias, _ = _case(1, 96, 64)
    assert Linear(weight, bias, native=False).kind != "native-bf16"  # --no-native-kernels
    assert "no-native-kernels" in native_gemm.unavailable_reason(False)
    assert Linear(weight.float(), bias.float()).kind != "native-bf16"
    assert Linear(weight, bias, prepack=False).kind == "native-bf16"  # --no-onednn concerns oneDNN only
    flags = cpu_features.cpu_flags()
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: flags | {"amx_bf16"})
    assert "AMX" in native_gemm.unavailable_reason()
    assert Linear(weight, bias).kind != "native-bf16"
    assert linear.bf16_gemm().startswith("oneDNN (")
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: flags - {"avx512_bf16", "amx_bf16"})
    assert "avx512_bf16" in native_gemm.unavailable_reason()


def test_packing_refuses_what_the_kernel_cannot_take() -> None:
    with pytest.raises(ValueError, match=r"\[16n, 2k\]"):
        native_gemm.PackedBf16Weight(torch.zeros(40, 64, dtype=torch.bfloat16), None)
    with pytest.raises(ValueError, match="float32"):
        native_gemm.PackedBf16Weight(torch.zeros(48, 64), None)
