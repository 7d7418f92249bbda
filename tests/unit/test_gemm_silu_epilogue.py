"""The native bf16 GEMMs' SiLU epilogue: an MLP's gate/up projection and silu(gate) * up in one pass,
in the GEMM that runs here (the AMX one with AMX, else the AVX512-BF16 one; silu_store.h is theirs).

Oracles: torch's own ``F.silu(gate) * up`` on the plain GEMM's rounded output (the plain GEMM has
its float64 oracle in test_native_gemm.py), and the separate SiLU step (``FusedOps.silu_and_mul``)
on that output. The epilogue computes the step's formula but its division exactly, where GCC
vectorizes the step's as a reciprocal estimate plus a Newton step: the two may differ by one bf16
step, rarely (gemm_bf16.c).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from refengine.config import KernelConfig
from refengine.kernels import amx_gemm, native_gemm
from refengine.kernels.fused import FusedOps
from refengine.kernels.linear import Linear
from refengine.model.llama import LlamaModel, LoraSlotShape
from tests.tiny_models import hf_weights, make_tiny_hf_model, model_config_from_hf
from tests.unit.gemm_helpers import assert_rows_do_not_depend_on_the_call

#: The native GEMM Linear picks here, and its packed weight class ("" / None: neither runs).
KIND, PACKED = (("amx-bf16", amx_gemm.PackedAmxWeight) if not amx_gemm.unavailable_reason()
                else ("native-bf16", native_gemm.PackedBf16Weight) if not native_gemm.unavailable_reason()
                else ("", None))
pytestmark = [pytest.mark.threads(2),  # the work split between threads (tests/conftest.py)
              pytest.mark.skipif(not KIND, reason=f"no native bf16 GEMM here: {amx_gemm.unavailable_reason()}; "
                                                 f"{native_gemm.unavailable_reason()}")]
NATIVE_OPS = FusedOps(native=True)
#: The GEMM's k step: the AMX GEMM takes k in steps of 32, the AVX512-BF16 one in pairs.
K_STEP = 32 if KIND == "amx-bf16" else 2


def _case(rows: int, inter: int, in_features: int, seed: int = 0, scale: float = 1.0):
    generator = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(2 * inter, in_features, generator=generator) * scale / in_features**0.5).bfloat16()
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    return gate_up, x


def _bf16_ulps(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    step = torch.where(expected == 0, torch.full_like(expected.double(), 2.0**-133), expected.double().abs() * 2**-7)
    return ((got.double() - expected.double()).abs() / step).floor()


# (rows, inter, in_features): inter 16/32/48 is a column tile of 2/4/6 panels, 80 a tile of 6 then
# one of 4, 1,536 SmolLM2's; rows cover every row-tile tail and several row tiles.
SHAPES = [s for s in [(1, 16, 2), (1, 16, 32), (2, 32, 64), (3, 48, 96), (4, 80, 128), (5, 1536, 576), (7, 48, 576),
                      (17, 48, 64), (33, 80, 96), (64, 1536, 576), (130, 80, 64)] if s[2] % K_STEP == 0]


@pytest.mark.parametrize("scale", [1.0, 24.0], ids=["unit", "wide"])  # wide: gates of +-50 and more
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_equals_the_gemm_then_the_silu_step(shape, scale: float) -> None:
    gate_up, x = _case(*shape, seed=shape[0], scale=scale)
    fused = Linear(gate_up, silu_and_mul=True)
    assert fused.kind == KIND and fused.applies_silu_and_mul
    plain = Linear(gate_up)(x)
    out = fused(x)
    assert out.shape == (shape[0], shape[1]) and out.dtype == torch.bfloat16
    gate, up = plain.chunk(2, dim=-1)
    torch_ulps = _bf16_ulps(out, F.silu(gate) * up)
    assert torch_ulps.max().item() <= 2 and (torch_ulps == 0).float().mean().item() >= 0.99
    # Below a gate of -87.3, 1 / (1 + e^-g) is a float32 denormal: the step's vectorized reciprocal
    # flushes it, and the step gives 0 where torch and the epilogue give g * that (about 1e-36).
    normal = gate > -87.3
    step_ulps = _bf16_ulps(out, NATIVE_OPS.silu_and_mul(plain))[normal]
    assert step_ulps.max().item() <= 1 and (step_ulps == 0).float().mean().item() >= 0.999


def test_gates_past_exp_overflow_give_zero_not_nan() -> None:
    """Gates near -100 (e^-g overflows float32) give silu = 0 as in torch, in the epilogue and in
    the separate step, float32 and bf16; before the cap both C paths gave NaN there."""
    gate_up, x = _case(16, 1536, 576, seed=7, scale=60.0)
    plain = Linear(gate_up)(x)
    gate, up = plain.chunk(2, dim=-1)
    assert (gate < -89).sum() > 100, "the case must reach the overflow"
    expected = F.silu(gate) * up
    for got in (Linear(gate_up, silu_and_mul=True)(x), NATIVE_OPS.silu_and_mul(plain)):
        assert not got.isnan().any()
        assert torch.equal(got[gate < -89].float(), expected[gate < -89].float())
    plain32 = plain.float()
    got32 = NATIVE_OPS.silu_and_mul(plain32)
    assert not got32.isnan().any()
    torch.testing.assert_close(got32, F.silu(plain32[:, :1536]) * plain32[:, 1536:], rtol=1e-5, atol=1e-30)


def test_infinite_gates_give_torchs_silu() -> None:
    """A gate sum that overflows to -inf gives NaN as torch's -inf * sigmoid(-inf) does (the epilogue
    gave 0), to +inf gives inf; the up sums are finite. (A NaN gate sum cannot be had without a NaN
    or inf in x, which makes up NaN too: silu.h's NaN test is the same one, checked in test_fused_ops.)"""
    x = torch.zeros(1, 64)
    x[0, :2], x[0, 2] = 3e38, 1.0  # two products of 3e38 overflow float32; column 2 a plain 1
    weight = torch.zeros(32, 64)
    weight[:8, :2], weight[8:16, :2], weight[16:, 2] = -1.0, 1.0, 2.0  # gates -inf, +inf; ups 2
    out = Linear(weight.bfloat16(), silu_and_mul=True)(x.bfloat16())
    assert out[0, :8].isnan().all() and torch.equal(out[0, 8:].float(), torch.full((8,), float("inf")))


def test_rows_do_not_depend_on_the_call() -> None:
    """G18: a row alone, in batches of every row-tile position, and on 1 or 2 threads: same bits."""
    gate_up, x = _case(37, 1536, 576, seed=3)
    assert_rows_do_not_depend_on_the_call(Linear(gate_up, silu_and_mul=True), x, (2, 5, 36), 6)


def test_who_takes_the_epilogue() -> None:
    gate_up, x = _case(3, 40, 64)  # 40: the halves are not whole panels of 16, [gate | up] is 5 panels
    layer = Linear(gate_up, silu_and_mul=True)
    assert layer.kind == KIND and not layer.applies_silu_and_mul
    assert torch.equal(layer(x), Linear(gate_up)(x))  # [gate | up], for the separate step
    assert not Linear(gate_up[:96], torch.zeros(96, dtype=torch.bfloat16), silu_and_mul=True).applies_silu_and_mul
    gate_up, x = _case(3, 48, 64)
    assert not Linear(gate_up.float(), silu_and_mul=True).applies_silu_and_mul  # float32: oneDNN
    assert not Linear(gate_up, silu_and_mul=True, native=False).applies_silu_and_mul
    assert not Linear(gate_up).applies_silu_and_mul
    with pytest.raises(ValueError, match="no bias"):
        PACKED(gate_up, torch.zeros(96, dtype=torch.bfloat16), silu_and_mul=True)
    with pytest.raises(ValueError, match=r"\[32n, " + str(K_STEP) + r"k\]"):
        PACKED(gate_up[:80], None, silu_and_mul=True)


def _bf16_model(lora: LoraSlotShape | None = None) -> LlamaModel:
    hf = make_tiny_hf_model(seed=11, intermediate_size=96)
    weights = {name: w.bfloat16() for name, w in hf_weights(hf).items()}
    return LlamaModel(model_config_from_hf(hf), weights, 64, KernelConfig(), lora)


def test_the_model_fuses_without_adapters_only() -> None:
    """Without LoRA slots every layer's gate/up runs the epilogue; with them (adapters add their
    deltas to [gate | up] before the SiLU) none does. Both give the same MLP input, to a bf16 step."""
    fused, with_slots = _bf16_model(), _bf16_model(LoraSlotShape(num_slots=2, max_rank=8))
    assert all(layer.silu_in_gate_up for layer in fused.layers)
    assert not any(layer.silu_in_gate_up for layer in with_slots.layers)
    x = torch.randn(9, 64).bfloat16()
    for layer, slotted in zip(fused.layers, with_slots.layers, strict=True):
        separate = NATIVE_OPS.silu_and_mul(slotted.gate_up_proj.base(x))
        assert _bf16_ulps(layer.gate_up_proj(x), separate).max().item() <= 1
