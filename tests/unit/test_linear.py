"""Linear (kernels/linear.py): the oneDNN-packed projection against F.linear (the native bf16
GEMM has its own tests, test_native_gemm.py; bf16 tests here pass native=False to reach oneDNN)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from refengine.kernels import linear
from refengine.kernels.cpu_features import native_bf16
from refengine.kernels.linear import Linear, onednn_available
from tests.unit.gemm_helpers import assert_rows_do_not_depend_on_the_call

pytestmark = pytest.mark.threads(2)  # the work split between threads (tests/conftest.py)

SHAPES = [(960, 576), (576, 1536)]  # (out_features, in_features)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _weights(out_features: int, in_features: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(out_features * 7 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    bias = torch.randn(out_features, generator=gen)
    return weight.to(dtype), bias.to(dtype)


@pytest.mark.parametrize("rows", [1, 7, 32, 300])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_matches_f_linear(shape, rows) -> None:
    weight, bias = _weights(*shape)
    x = torch.randn(rows, shape[1])
    plain, biased = Linear(weight), Linear(weight, bias)
    assert plain.out_features == biased.out_features == shape[0]
    assert plain.in_features == biased.in_features == shape[1]
    for layer, b in ((plain, None), (biased, bias)):
        out = layer(x)
        assert out.shape == (rows, shape[0]) and out.dtype == torch.float32
        torch.testing.assert_close(out, F.linear(x, weight, b), atol=1e-4, rtol=0)


def test_packed_on_cpu_float32() -> None:
    weight, bias = _weights(*SHAPES[0])
    assert (Linear(weight, bias).kind == "onednn") == onednn_available()
    if torch.backends.mkldnn.is_available():
        assert onednn_available(), "oneDNN is there but the packed op failed its self-check"


@pytest.mark.parametrize("view", ["transposed", "column_slice"])
def test_non_contiguous_input(view) -> None:
    out_features, in_features = SHAPES[0]
    weight, bias = _weights(out_features, in_features)
    if view == "transposed":
        x = torch.randn(in_features, 13).t()
    else:
        x = torch.randn(13, in_features + 100)[:, 50 : 50 + in_features]
    assert not x.is_contiguous()
    layer = Linear(weight, bias)
    torch.testing.assert_close(layer(x), F.linear(x.contiguous(), weight, bias), atol=1e-4, rtol=0)


@pytest.mark.parametrize("native", [True, False])
def test_bfloat16_packed_only_with_native_bf16(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 weights are prepacked where the CPU has native bf16 dot products (and the packed op
    agrees with F.linear); elsewhere they stay for F.linear. Both are correct."""
    if native and not native_bf16():
        pytest.skip("this CPU has no native bf16 (avx512_bf16 / amx_bf16)")
    monkeypatch.setattr(linear, "native_bf16", lambda: native)
    onednn_available.cache_clear()
    weight, bias = _weights(*SHAPES[1], dtype=torch.bfloat16)
    layer = Linear(weight, bias, native=False)
    onednn_available.cache_clear()
    assert (layer.kind == "onednn") == (native and torch.backends.mkldnn.is_available())
    assert (layer.out_features, layer.in_features) == SHAPES[1]
    x = torch.randn(7, SHAPES[1][1]).to(torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    expected = F.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(out.float(), expected, atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=5e-2, rtol=2e-2)


def test_prepack_false_keeps_f_linear() -> None:
    """KernelConfig.onednn_linear = False (--no-onednn) reaches Linear as prepack=False."""
    weight, bias = _weights(*SHAPES[0])
    layer = Linear(weight, bias, prepack=False)
    assert layer.kind == "torch"
    assert layer.weight is weight  # kept as given
    x = torch.randn(7, SHAPES[0][1])
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), atol=1e-4, rtol=0)


def test_onednn_switch_is_not_read_from_the_environment(monkeypatch) -> None:
    """The retired REFENGINE_ONEDNN variable no longer changes anything: the switch is a parameter."""
    monkeypatch.setenv("REFENGINE_ONEDNN", "0")
    onednn_available.cache_clear()
    try:
        weight, bias = _weights(*SHAPES[0])
        assert (Linear(weight, bias).kind == "onednn") == onednn_available() == torch.backends.mkldnn.is_available()
    finally:
        onednn_available.cache_clear()


@pytest.mark.skipif(not onednn_available(), reason="oneDNN's packed float32 linear is not available")
@pytest.mark.parametrize("shape", [(576, 1536), (960, 576), (3072, 576)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_float32_rows_do_not_depend_on_the_row_count(shape) -> None:
    """G18 in float32: each row alone equals the same row in a batch of 2, 5 or 64, bit for bit.
    oneDNN's own 1-row kernel differed by up to 4.5e-6 at 576x1536 (an AMD Zen 4), which flipped a
    greedy near-tie in tests/golden/test_kv_cache_dtype_golden.py; see linear.py."""
    weight, bias = _weights(*shape)
    layer = Linear(weight, bias)
    assert layer.kind == "onednn"
    x = torch.randn(64, shape[1], generator=torch.Generator().manual_seed(2))
    assert_rows_do_not_depend_on_the_call(layer, x, (2, 5), 7, one_thread=False)


@pytest.mark.skipif(not native_bf16() or not onednn_available(torch.bfloat16),
                    reason="the packed bf16 path needs a CPU with native bf16 and oneDNN")
@pytest.mark.parametrize("shape", [(576, 1536), (960, 576), (3072, 576)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_bfloat16_rows_do_not_depend_on_the_row_count(shape) -> None:
    """G18 in bf16: each row alone equals the same row in a batch of 2, 5, 64 or 100, bit for bit,
    and so does a row beside other neighbours, at another place in its call. oneDNN's kernel, and
    its rounding, changes with the row count (a single row on a Zen 4; whole ranges of counts on
    AMX); see linear.py."""
    generator = torch.Generator().manual_seed(1)
    layer = Linear(torch.randn(*shape, generator=generator).bfloat16(), native=False)
    assert layer.kind == "onednn"
    x = torch.randn(100, shape[1], generator=generator).bfloat16()
    assert_rows_do_not_depend_on_the_call(layer, x, (2, 5, 64), 7, one_thread=False)
    batch = layer(x)
    neighbours = torch.randn(40, shape[1], generator=generator).bfloat16()
    neighbours[37] = x[3]
    assert torch.equal(layer(neighbours)[37], batch[3])


@pytest.mark.skipif(not native_bf16() or not onednn_available(torch.bfloat16),
                    reason="the packed bf16 path needs a CPU with native bf16 and oneDNN")
def test_bfloat16_calls_keep_their_shape() -> None:
    """The fixed-count bf16 calls return what ``F.linear`` would: any leading dims, zero rows."""
    generator = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(48, 64, generator=generator).bfloat16(), torch.randn(48, generator=generator).bfloat16()
    layer = Linear(weight, bias, native=False)
    assert layer.kind == "onednn"
    for shape in [(0, 64), (3, 64), (2, 35, 64)]:
        x = torch.randn(*shape, generator=generator).bfloat16()
        out = layer(x)
        assert out.shape == (*shape[:-1], 48)
        torch.testing.assert_close(out.float(), F.linear(x.float(), weight.float(), bias.float()),
                                   atol=0.25, rtol=2e-2)
