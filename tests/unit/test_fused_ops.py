"""The fused decoder-layer steps (kernels/fused.py): the native C path against the
torch fallback and against transformers' own Llama functions as the oracle."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from refengine.kernels import cpu, fused

pytestmark = pytest.mark.threads(2)  # the work split between threads (tests/conftest.py)

NATIVE = fused._library() is not None
native_only = pytest.mark.skipif(not NATIVE, reason="native fused ops unavailable (no C compiler?)")


@pytest.fixture(params=["native", "torch"])
def ops(request) -> fused.FusedOps:
    """The ops on one path: native (the C kernels) or torch (FusedOps(native=False), as
    KernelConfig.native_cpu_kernels = False gives the model)."""
    if request.param == "native" and not NATIVE:
        pytest.skip("native fused ops unavailable (no C compiler?)")
    return fused.FusedOps(native=request.param == "native")


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = LlamaRMSNorm(x.shape[-1], eps=eps).to(weight.dtype)
    norm.weight.data.copy_(weight)
    with torch.no_grad():
        return norm(x)


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_transformers(ops, rows, with_delta) -> None:
    g = torch.Generator().manual_seed(rows)
    residual = torch.randn(rows, 576, generator=g) * 3
    delta = torch.randn(rows, 576, generator=g) if with_delta else None
    weight = torch.randn(576, generator=g)
    expected_residual = residual + delta if with_delta else residual.clone()
    out = ops.add_rms_norm(residual, delta, weight, 1e-5)
    assert (residual - expected_residual).abs().max() <= 1e-6, "the residual stream is updated in place"
    assert (out - hf_rms_norm(expected_residual, weight, 1e-5)).abs().max() <= 1e-5


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bfloat16 steps apart two bfloat16 tensors are, element by element (the
    bit patterns as ordered integers: negative values mirrored so the order is monotonic)."""
    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.view(torch.int16).int()
        return torch.where(bits < 0, -32768 - bits, bits)
    return (ordered(a) - ordered(b)).abs()


def bf16_case(rows: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"residual": (torch.randn(rows, 576, generator=g) * 3).bfloat16(),
            "delta": torch.randn(rows, 576, generator=g).bfloat16(),
            "weight": torch.randn(576, generator=g).bfloat16(),
            "gate_up": (torch.randn(rows, 2 * 1536, generator=g) * 4).bfloat16()}


@native_only
@pytest.mark.parametrize("rows", [1, 64, 300])
def test_bfloat16_kernels_round_where_the_torch_form_rounds(rows) -> None:
    """The bf16 C kernels against FusedOps(native=False) on the same bf16 tensors: the
    residual add is exact; the outputs differ rarely (a last-bit difference of a float32
    reduction or of expf that crosses a rounding boundary), by at most two bf16 steps: a one-step
    difference in the first rounding can become two after the product that follows it (with the
    weight in RMSNorm, with ``up`` in SiLU-and-mul)."""
    case = bf16_case(rows, rows)
    native, reference = fused.FusedOps(native=True), fused.FusedOps(native=False)
    native_residual, reference_residual = case["residual"].clone(), case["residual"].clone()
    normed = native.add_rms_norm(native_residual, case["delta"], case["weight"], 1e-5)
    expected = reference.add_rms_norm(reference_residual, case["delta"], case["weight"], 1e-5)
    assert normed.dtype == torch.bfloat16
    assert torch.equal(native_residual, reference_residual)
    assert bf16_ulps(normed, expected).max() <= 2 and (normed != expected).float().mean() < 1e-3
    oracle = hf_rms_norm(reference_residual, case["weight"], 1e-5)  # transformers' LlamaRMSNorm in bf16
    assert bf16_ulps(normed, oracle).max() <= 2 and (normed != oracle).float().mean() < 1e-3
    silu, silu_expected = native.silu_and_mul(case["gate_up"]), reference.silu_and_mul(case["gate_up"])
    assert bf16_ulps(silu, silu_expected).max() <= 2 and (silu != silu_expected).float().mean() < 1e-2


@native_only
def test_bfloat16_rotary_equals_the_torch_form() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(37, 12, 64, generator=g).bfloat16()
    positions = torch.randint(0, 512, (37,), generator=g)
    cos, signed_sin = (torch.randn(512, 64, generator=g).bfloat16() for _ in range(2))
    native_x, reference_x = x.clone(), x.clone()
    fused.FusedOps(native=True).rotary_(native_x, positions, cos, signed_sin)
    fused.FusedOps(native=False).rotary_(reference_x, positions, cos, signed_sin)
    assert bf16_ulps(native_x, reference_x).max() <= 1 and (native_x != reference_x).float().mean() < 1e-3


@native_only
def test_bfloat16_rows_do_not_depend_on_the_batch() -> None:
    case = bf16_case(64, 7)
    alone_residual = case["residual"][5:6].clone()
    alone = fused.add_rms_norm(alone_residual, case["delta"][5:6].clone(), case["weight"], 1e-5)
    batch = fused.add_rms_norm(case["residual"], case["delta"], case["weight"], 1e-5)
    assert torch.equal(alone[0], batch[5]) and torch.equal(alone_residual[0], case["residual"][5])
    assert torch.equal(fused.silu_and_mul(case["gate_up"][5:6].clone())[0], fused.silu_and_mul(case["gate_up"])[5])


def test_float16_takes_the_torch_form() -> None:
    """The C library has float32 and bfloat16 only: float16 on CPU runs the torch form."""
    x = torch.randn(4, 64).half()
    weight = torch.randn(64).half()
    assert torch.equal(fused.add_rms_norm(x.clone(), None, weight, 1e-6), fused.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_silu_and_mul(ops, rows) -> None:
    gate_up = torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_on_a_strided_qkv_view_matches_transformers(ops, head_dim) -> None:
    """Queries and keys rotated in place inside the fused QKV output, as the model does."""
    heads, kv_heads, tokens, max_pos = 6, 2, 9, 512
    g = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g)
    positions = torch.randint(0, max_pos, (tokens,), generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    half = head_dim // 2
    signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)

    q_ref = qkv[:, : heads * head_dim].view(tokens, heads, head_dim).transpose(0, 1)[None]
    k_ref = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    k_ref = k_ref.transpose(0, 1)[None]
    q_hf, k_hf = apply_rotary_pos_emb(q_ref.clone(), k_ref.clone(), cos[positions][None], sin[positions][None])
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()

    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    ops.rotary_(qk, positions, cos, signed_sin)
    assert (qk[:, :heads] - q_hf[0].transpose(0, 1)).abs().max() <= 1e-5
    assert (qk[:, heads:] - k_hf[0].transpose(0, 1)).abs().max() <= 1e-5
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before), "values must be left alone"


@pytest.mark.parametrize("rows", [1, 9])
def test_rms_norm_matches_transformers_and_leaves_x(ops, rows) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g) * 3
    weight = torch.randn(576, generator=g)
    before = x.clone()
    out = ops.rms_norm(x, weight, 1e-5)
    assert torch.equal(x, before)
    assert (out - hf_rms_norm(before, weight, 1e-5)).abs().max() <= 1e-5
    assert (out - fused.rms_norm(before, weight, 1e-5)).abs().max() <= 1e-5


def test_torch_path_never_loads_the_library(monkeypatch) -> None:
    """native=False must not even ask for the kernels (no build on a --no-native-kernels run)."""
    def refuse() -> None:
        raise AssertionError("FusedOps(native=False) asked for the native library")

    monkeypatch.setattr(fused, "_library", refuse)
    ops = fused.FusedOps(native=False)
    x = torch.randn(3, 64)
    ops.add_rms_norm(x, torch.randn(3, 64), torch.randn(64), 1e-6)
    ops.rms_norm(x, torch.randn(64), 1e-6)
    ops.silu_and_mul(torch.randn(3, 128))
    table = torch.randn(8, 16)
    ops.rotary_(torch.randn(3, 2, 16), torch.tensor([0, 1, 7]), table, table)


@native_only
def test_module_functions_are_the_native_ops() -> None:
    """The module-level functions (what the model calls today) are FusedOps(native=True)'s,
    bit for bit, on the kernel path."""
    g = torch.Generator().manual_seed(3)
    residual, delta = torch.randn(5, 576, generator=g), torch.randn(5, 576, generator=g)
    weight = torch.randn(576, generator=g)
    gate_up = torch.randn(5, 3072, generator=g)
    native = fused.FusedOps(native=True)
    a_residual, b_residual = residual.clone(), residual.clone()
    assert torch.equal(fused.add_rms_norm(a_residual, delta, weight, 1e-5),
                       native.add_rms_norm(b_residual, delta, weight, 1e-5))
    assert torch.equal(a_residual, b_residual)
    assert torch.equal(fused.silu_and_mul(gate_up), native.silu_and_mul(gate_up))


@native_only
def test_native_rows_do_not_depend_on_the_batch() -> None:
    g = torch.Generator().manual_seed(0)
    residual = torch.randn(64, 576, generator=g)
    delta = torch.randn(64, 576, generator=g)
    weight = torch.randn(576, generator=g)
    gate_up = torch.randn(64, 3072, generator=g)
    alone_residual = residual[5:6].clone()
    alone = fused.add_rms_norm(alone_residual, delta[5:6].clone(), weight, 1e-5)
    batch = fused.add_rms_norm(residual, delta, weight, 1e-5)  # 64 x 576: run on several threads
    assert torch.equal(alone[0], batch[5]) and torch.equal(alone_residual[0], residual[5])
    assert torch.equal(fused.silu_and_mul(gate_up[5:6].clone())[0], fused.silu_and_mul(gate_up)[5])


def test_loading_the_native_kernels_keeps_subnormal_floats() -> None:
    """Linking with -ffast-math would add crtfastmath.o, which turns on flush-to-zero for
    the whole process when the library loads; the kernels are linked without it."""
    for name in ("paged_attention", "fused_ops"):
        cpu.load(name)
    tiny = torch.tensor([1e-40], dtype=torch.float32)  # a float32 subnormal
    assert (tiny * 1.0).item() != 0.0
    halved = sys.float_info.min
    halved /= 2
    assert halved > 0.0


@native_only
def test_add_rms_norm_kernel_takes_only_what_it_reads() -> None:
    """A strided weight, a 3-D residual and a delta that broadcasts give the torch form's result on
    the native path; the kernel, which reads contiguous [T, hidden] and [hidden], once took them."""
    g = torch.Generator().manual_seed(11)
    native, reference = fused.FusedOps(native=True), fused.FusedOps(native=False)
    strided_weight = torch.randn(2 * 64, generator=g)[::2]
    cases = [(torch.randn(4, 64, generator=g), None, strided_weight),
             (torch.randn(2, 3, 64, generator=g), None, torch.randn(64, generator=g)),
             (torch.randn(4, 64, generator=g), torch.randn(1, 64, generator=g), torch.randn(64, generator=g))]
    for residual, delta, weight in cases:
        native_residual, reference_residual = residual.clone(), residual.clone()
        out = native.add_rms_norm(native_residual, delta, weight, 1e-5)
        assert torch.equal(out, reference.add_rms_norm(reference_residual, delta, weight, 1e-5))
        assert torch.equal(native_residual, reference_residual)


@native_only
def test_silu_and_mul_kernel_takes_only_2d_even_rows() -> None:
    """A 3-D gate_up gives the torch form's [..., inter] (the kernel read it as 2-D: shape (2, 1));
    an odd width, which the torch form refuses, is refused too rather than split by the kernel."""
    gate_up = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(12))
    out = fused.FusedOps(native=True).silu_and_mul(gate_up)
    assert torch.equal(out, fused.FusedOps(native=False).silu_and_mul(gate_up)) and out.shape == (2, 3, 64)
    with pytest.raises(RuntimeError):
        fused.FusedOps(native=True).silu_and_mul(torch.randn(3, 5))


@native_only
def test_rotary_kernel_takes_only_what_it_reads() -> None:
    """Strided tables, an odd head size and a negative position give the torch form's result; a
    position past the tables raises IndexError as the torch form does, leaving x as it was (the
    kernel once read past the tables)."""
    g = torch.Generator().manual_seed(13)
    native, reference = fused.FusedOps(native=True), fused.FusedOps(native=False)
    wide = torch.randn(10, 16, generator=g)
    cases = [(torch.randn(3, 2, 8, generator=g), torch.tensor([1, 5, 9]), wide[:, ::2], wide[:, 1::2]),
             (torch.randn(3, 2, 5, generator=g), torch.tensor([1, 5, 9]), wide[:, :5].clone(), wide[:, 5:10].clone()),
             (torch.randn(3, 2, 8, generator=g), torch.tensor([1, -1, 9]), wide[:, :8].clone(), wide[:, 8:].clone())]
    for x, positions, cos, signed_sin in cases:
        native_x, reference_x = x.clone(), x.clone()
        native.rotary_(native_x, positions, cos, signed_sin)
        reference.rotary_(reference_x, positions, cos, signed_sin)
        assert torch.equal(native_x, reference_x)
    x, cos, signed_sin = cases[2][0], cases[2][2], cases[2][3]
    for dtype in (torch.float32, torch.bfloat16):
        rotated = x.to(dtype)
        with pytest.raises(IndexError):
            native.rotary_(rotated, torch.tensor([1, 5, 10]), cos.to(dtype), signed_sin.to(dtype))
        assert torch.equal(rotated, x.to(dtype))


@native_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_of_nan_and_infinite_gates_is_torchs(dtype) -> None:
    """NaN and -inf gates give NaN (torch: -inf * sigmoid(-inf) = -inf * 0), +inf gives inf, gates
    below exp's overflow 0, in every column: 37 of them put each value in the vector body and in the
    scalar tail. Under -ffast-math a NaN gate gave 0 (bf16: 0 in the tail only), a -inf gate 0."""
    specials = torch.tensor([float("nan"), float("-inf"), float("inf"), -100.0, -88.8, 0.0, 1.5, -3.0])
    gate = specials.repeat(5)[:37]
    up = torch.randn(37, generator=torch.Generator().manual_seed(14)) + 3.0  # finite, not 0
    gate_up = torch.cat([gate, up])[None].to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    out = fused.FusedOps(native=True).silu_and_mul(gate_up)
    torch.testing.assert_close(out, F.silu(gate) * up, equal_nan=True, rtol=1e-5, atol=1e-30)
    assert torch.equal(out.isnan(), gate.isnan() | (gate == float("-inf")))
