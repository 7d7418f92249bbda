"""The Triton fused decoder-layer steps (kernels/triton_ops.py) against the torch forms of
kernels/fused.py (``FusedOps(native=False)``), which define their semantics, and
``FusedOps``' choice of path.

Where the kernels run: on CUDA when there is a GPU (compiled, in this process); otherwise
on the CPU under Triton's interpreter, in fp32 and fp16 (its bf16 arithmetic is wrong;
bf16 is checked on CUDA alone). As in test_lora_triton.py, the interpreter cannot be
switched on inside this process (``TRITON_INTERPRET`` is read when ``triton.jit``
decorates a function, and ``import triton`` decorates its own helpers), so
``test_kernels_on_the_interpreter`` runs this file again in a subprocess with
``TRITON_INTERPRET=1``, where the kernel tests run on the CPU.

Shapes are small and ragged: 1, 7 and 33 rows; hidden 64 and 96 (not a power of two);
head_dim 64 and 128 with GQA-like query/key head counts; positions out of order; rotary
tables built by ``RotaryEmbedding`` with default and llama3-scaled frequencies.
"""

from __future__ import annotations

import functools
import importlib.util
import sys

import pytest
import torch

from refengine.config import ModelConfig
from refengine.kernels import fused, triton_ops
from refengine.model.rope import RotaryEmbedding
from tests.triton_interpreter import (
    DEVICE,
    INTERPRET,
    in_a_subprocess,
    kernel_test,
    requires_triton,
    run_interpreted,
)

pytestmark = pytest.mark.triton

DTYPES = [torch.float32, torch.float16]
TORCH = fused.FusedOps(native=False)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 1024}
MAX_POSITIONS = 4096  # four times the llama3 original context: positions reach the scaled frequencies


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    """fp32: tight (summation order, fused multiply-adds); fp16, bf16: one unit in the last place."""
    return {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.float16: {"rtol": 1e-3, "atol": 1e-3},
            torch.bfloat16: {"rtol": 8e-3, "atol": 8e-3}}[dtype]


def assert_matches(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Within ``tolerances``; in fp16 / bf16 also bit for bit but for rare last-bit flips (libm
    ``exp`` / ``rsqrt`` differences at a rounding boundary), as the kernels round where the
    torch forms round: a missing intermediate rounding would change far more elements."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, **tolerances(got.dtype))
    if got.dtype != torch.float32:
        mismatched = (got != expected).float().mean().item()
        assert mismatched <= 0.01, f"{mismatched:.1%} of the {got.dtype} elements differ from the torch form"


@requires_triton
@in_a_subprocess
def test_kernels_on_the_interpreter() -> None:
    run_interpreted(__file__)


@kernel_test
def test_kernels_are_interpreted_or_compiled() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    assert triton_ops.triton_available()
    for kernel in (triton_ops._add_rms_norm_kernel, triton_ops._silu_and_mul_kernel, triton_ops._rotary_kernel):
        assert isinstance(kernel, InterpretedFunction) == INTERPRET


def test_without_triton_the_module_imports_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """A private copy of the module loaded with ``import triton`` failing (a CPU-only
    install): it imports, handles nothing, and its entries refuse to run."""
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.spec_from_file_location("_triton_ops_without_triton", triton_ops.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not module.triton_available() and not module.handles(torch.zeros(1))
    with pytest.raises(RuntimeError, match="needs Triton"):
        module.silu_and_mul(torch.zeros(1, 4))


def test_without_cuda_fused_ops_keep_their_cpu_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CUDA tensor, no Triton launch: CPU tensors (fp32, which the C kernels take, and
    fp16, which the torch forms take) never reach triton_ops, even under the interpreter."""
    def refuse(*args: object) -> None:
        raise AssertionError("a CPU tensor reached the Triton kernels")

    for name in ("add_rms_norm", "silu_and_mul", "rotary_"):
        monkeypatch.setattr(triton_ops, name, refuse)
    ops = fused.FusedOps(native=True)
    g = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        residual, delta = torch.randn(7, 96, generator=g).to(dtype), torch.randn(7, 96, generator=g).to(dtype)
        weight = torch.randn(96, generator=g).to(dtype)
        assert not triton_ops.handles(residual, delta, weight)
        expected_residual = residual.clone()
        expected = TORCH.add_rms_norm(expected_residual, delta, weight, 1e-5)
        torch.testing.assert_close(ops.add_rms_norm(residual, delta, weight, 1e-5), expected, **tolerances(dtype))
        torch.testing.assert_close(residual, expected_residual, **tolerances(dtype))
        gate_up = torch.randn(7, 128, generator=g).to(dtype)
        torch.testing.assert_close(ops.silu_and_mul(gate_up), TORCH.silu_and_mul(gate_up), **tolerances(dtype))
        x, table = torch.randn(7, 3, 16, generator=g).to(dtype), torch.randn(64, 16, generator=g).to(dtype)
        positions = torch.tensor([5, 0, 63, 2, 2, 40, 1])
        expected_x = x.clone()
        TORCH.rotary_(expected_x, positions, table, table)
        ops.rotary_(x, positions, table, table)
        torch.testing.assert_close(x, expected_x, **tolerances(dtype))


@kernel_test
def test_fused_ops_send_triton_device_tensors_to_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """FusedOps(native=True) hands the tensors ``handles`` accepts (CUDA ones; here also the
    interpreter's CPU ones) to triton_ops; FusedOps(native=False) never does."""
    calls: list[str] = []

    def spy(name: str):
        kernel = getattr(triton_ops, name)
        return lambda *args: calls.append(name) or kernel(*args)

    monkeypatch.setattr(triton_ops, "handles", lambda *tensors: all(t.device.type == DEVICE for t in tensors))
    for name in ("add_rms_norm", "silu_and_mul", "rotary_"):
        monkeypatch.setattr(triton_ops, name, spy(name))
    g = torch.Generator().manual_seed(1)
    residual, delta = torch.randn(7, 64, generator=g).to(DEVICE), torch.randn(7, 64, generator=g).to(DEVICE)
    weight, gate_up = torch.randn(64, generator=g).to(DEVICE), torch.randn(7, 128, generator=g).to(DEVICE)
    x, table = torch.randn(7, 3, 16, generator=g).to(DEVICE), torch.randn(64, 16, generator=g).to(DEVICE)
    positions = torch.tensor([5, 0, 63, 2, 2, 40, 1], device=DEVICE)
    results = {}
    for native in (True, False):
        ops, r, y = fused.FusedOps(native=native), residual.clone(), x.clone()
        ops.rotary_(y, positions, table, table)
        results[native] = (ops.add_rms_norm(r, delta, weight, 1e-5), r, ops.silu_and_mul(gate_up), y)
        assert calls == (["rotary_", "add_rms_norm", "silu_and_mul"] if native else [])
        calls.clear()
    for got, expected in zip(results[True], results[False], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def check_add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> None:
    """The kernel against the torch form on copies: the returned rows and the residual
    update (the same rounded sums, bit for bit)."""
    expected_residual = residual.clone()
    expected = TORCH.add_rms_norm(expected_residual, delta, weight, 1e-5)
    assert_matches(triton_ops.add_rms_norm(residual, delta, weight, 1e-5), expected)
    assert torch.equal(residual, expected_residual)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_delta", [True, False])
@pytest.mark.parametrize("hidden", [64, 96])
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_add_rms_norm(rows: int, hidden: int, with_delta: bool, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows * hidden)
    residual = (torch.randn(rows, hidden, generator=g) * 3).to(DEVICE, dtype)
    delta = torch.randn(rows, hidden, generator=g).to(DEVICE, dtype) if with_delta else None
    weight = torch.randn(hidden, generator=g).to(DEVICE, dtype)
    before = residual.clone()
    check_add_rms_norm(residual, delta, weight)
    assert with_delta or torch.equal(residual, before), "without a delta the residual is left alone"


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 80])
def test_add_rms_norm_wide_rows_take_two_passes(monkeypatch: pytest.MonkeyPatch, hidden: int,
                                                dtype: torch.dtype) -> None:
    """Rows wider than MAX_BLOCK (made 32 here) are walked in chunks, twice; 80 ends ragged."""
    monkeypatch.setattr(triton_ops, "MAX_BLOCK", 32)
    g = torch.Generator().manual_seed(hidden)
    residual = (torch.randn(7, hidden, generator=g) * 3).to(DEVICE, dtype)
    weight = torch.randn(hidden, generator=g).to(DEVICE, dtype)
    check_add_rms_norm(residual, torch.randn(7, hidden, generator=g).to(DEVICE, dtype), weight)
    check_add_rms_norm(residual, None, weight)


@kernel_test
def test_add_rms_norm_strided_residual_and_mixed_weight() -> None:
    """The residual as a column slice of a wider tensor (updated through the view, the
    other columns left alone) or transposed (no row view: updated through a copy); an fp32
    weight on fp16 rows returns fp32, as the torch form's promotion does."""
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(7, 128, generator=g).to(DEVICE)
    weight, delta = torch.randn(96, generator=g).to(DEVICE), torch.randn(7, 96, generator=g).to(DEVICE)
    outside = wide[:, 96:].clone()
    check_add_rms_norm(wide[:, :96], delta, weight)
    assert torch.equal(wide[:, 96:], outside)
    check_add_rms_norm(torch.randn(96, 7, generator=g).to(DEVICE).t(), delta, weight)
    check_add_rms_norm(torch.randn(7, 96, generator=g).to(DEVICE, torch.float16), delta.half(), weight)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "inter"), [(1, 64), (7, 96), (33, 64), (33, 96), (2, 1100)])
def test_silu_and_mul(rows: int, inter: int, dtype: torch.dtype) -> None:
    """1100 columns span two 1024-wide column blocks, the second ragged."""
    gate_up = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4).to(DEVICE, dtype)
    assert_matches(triton_ops.silu_and_mul(gate_up), TORCH.silu_and_mul(gate_up))


@kernel_test
def test_silu_and_mul_on_a_strided_view() -> None:
    wide = torch.randn(7, 2 * 96 + 16, generator=torch.Generator().manual_seed(3)).to(DEVICE) * 4
    gate_up = wide[:, 16:]
    torch.testing.assert_close(triton_ops.silu_and_mul(gate_up), TORCH.silu_and_mul(gate_up), rtol=1e-5, atol=1e-5)


@functools.cache
def tables(head_dim: int, scaling: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``RotaryEmbedding``'s cos / signed_sin tables, as the model builds them."""
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=4 * head_dim,
                         intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1,
                         head_dim=head_dim, max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-5,
                         rope_theta=500000.0, rope_scaling=LLAMA3 if scaling == "llama3" else None)
    rope = RotaryEmbedding(config, MAX_POSITIONS, dtype, DEVICE, TORCH)
    return rope.cos, rope.signed_sin


@kernel_test
def test_llama3_tables_differ_from_the_default() -> None:
    """The llama3 case below is a different rotation (low frequencies are scaled)."""
    assert not torch.allclose(tables(64, "llama3", torch.float32)[0], tables(64, "default", torch.float32)[0])


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", ["default", "llama3"])
@pytest.mark.parametrize(("rows", "head_dim", "heads", "kv_heads"),
                         [(1, 64, 6, 2), (7, 128, 4, 1), (33, 64, 4, 1), (7, 128, 32, 8)])
def test_rotary_on_the_fused_qkv_view(rows: int, head_dim: int, heads: int, kv_heads: int, scaling: str,
                                      dtype: torch.dtype) -> None:
    """Queries and keys rotated together in place inside the fused QKV output (row stride
    wider than the view), as the model does; values left alone. 5 heads are a ragged head
    block; 40 heads of 128 take a full and a ragged block of 32."""
    g = torch.Generator().manual_seed(rows * head_dim + heads)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE, dtype)
    positions = torch.randperm(MAX_POSITIONS, generator=g)[:rows].to(DEVICE)
    cos, signed_sin = tables(head_dim, scaling, dtype)
    qk_size = (heads + kv_heads) * head_dim
    v_before = qkv[:, qk_size:].clone()
    expected = qkv[:, :qk_size].reshape(rows, heads + kv_heads, head_dim).clone()
    TORCH.rotary_(expected, positions, cos, signed_sin)
    qk = qkv[:, :qk_size].view(rows, heads + kv_heads, head_dim)
    triton_ops.rotary_(qk, positions, cos, signed_sin)
    assert_matches(qk, expected)
    assert torch.equal(qkv[:, qk_size:], v_before), "values must be left alone"


@kernel_test
def test_rotary_int32_positions_and_repeats() -> None:
    """int32 positions (the torch form indexes with them too), one position twice."""
    cos, signed_sin = tables(64, "llama3", torch.float32)
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    positions = torch.tensor([4095, 3, 1500, 3, 0], dtype=torch.int32, device=DEVICE)
    expected = x.clone()
    TORCH.rotary_(expected, positions.long(), cos, signed_sin)
    triton_ops.rotary_(x, positions, cos, signed_sin)
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-5)


@kernel_test
def test_empty_batches_launch_nothing() -> None:
    weight = torch.randn(64).to(DEVICE)
    assert triton_ops.add_rms_norm(torch.empty(0, 64, device=DEVICE), None, weight, 1e-5).shape == (0, 64)
    assert triton_ops.silu_and_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)
    cos, signed_sin = tables(64, "default", torch.float32)
    triton_ops.rotary_(torch.empty(0, 3, 64, device=DEVICE), torch.empty(0, dtype=torch.long, device=DEVICE),
                       cos, signed_sin)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA (the interpreter's bf16 is wrong)")
def test_bfloat16_on_cuda() -> None:
    """bf16 at model-like sizes against the torch forms on the same device."""
    g = torch.Generator().manual_seed(5)
    residual = (torch.randn(300, 2048, generator=g) * 3).to(DEVICE, torch.bfloat16)
    delta = torch.randn(300, 2048, generator=g).to(DEVICE, torch.bfloat16)
    weight = torch.randn(2048, generator=g).to(DEVICE, torch.bfloat16)
    expected_residual = residual.clone()
    expected = TORCH.add_rms_norm(expected_residual, delta, weight, 1e-5)
    assert_matches(triton_ops.add_rms_norm(residual, delta, weight, 1e-5), expected)
    assert torch.equal(residual, expected_residual)
    gate_up = (torch.randn(300, 2 * 5632, generator=g) * 4).to(DEVICE, torch.bfloat16)
    assert_matches(triton_ops.silu_and_mul(gate_up), TORCH.silu_and_mul(gate_up))
    cos, signed_sin = tables(128, "llama3", torch.bfloat16)
    qk = torch.randn(300, 40, 128, generator=g).to(DEVICE, torch.bfloat16)
    positions = torch.randint(0, MAX_POSITIONS, (300,), generator=g).to(DEVICE)
    expected_qk = qk.clone()
    TORCH.rotary_(expected_qk, positions, cos, signed_sin)
    triton_ops.rotary_(qk, positions, cos, signed_sin)
    assert_matches(qk, expected_qk)
