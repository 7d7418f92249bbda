"""The Triton multi-LoRA kernels (kernels/lora_triton.py) against the torch reference
(kernels/lora.py's ``apply_lora_parts``), plus ``LoraBatch.build``'s invariants.

Where the kernels run: on CUDA when there is a GPU (compiled, in this process); otherwise
on the CPU under Triton's interpreter, in fp32 (its bf16 arithmetic is wrong). The
interpreter cannot be switched on inside this process: ``TRITON_INTERPRET`` is read when a
function is decorated with ``triton.jit``, and ``import triton`` already decorates
``triton.language``'s own helpers (``tl.zeros``...), so it must be set before anything
imports Triton, and leaving it set would turn every later Triton kernel of the test
session into an interpreted one. So ``test_kernels_on_the_interpreter`` runs this file
again in a subprocess with ``TRITON_INTERPRET=1``, where the kernel tests run on the CPU.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys

import pytest
import torch

from refengine.kernels import lora_triton
from refengine.kernels.lora import LoraBatch, apply_lora_parts
from tests.triton_interpreter import (
    DEVICE,
    INTERPRET,
    in_a_subprocess,
    kernel_test,
    requires_triton,
    run_interpreted,
)


@requires_triton
@in_a_subprocess
def test_kernels_on_the_interpreter() -> None:
    run_interpreted(__file__)


@kernel_test
def test_kernels_are_interpreted_or_compiled() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    assert lora_triton.triton_available()
    assert isinstance(lora_triton.shrink, InterpretedFunction) == INTERPRET
    assert isinstance(lora_triton.expand, InterpretedFunction) == INTERPRET


def test_without_triton_the_module_imports_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """A private copy of the module loaded with ``import triton`` failing (as on a CPU-only
    install): it imports, ``triton_available()`` is False, the entry refuses to run."""
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.spec_from_file_location("_lora_triton_without_triton", lora_triton.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not module.triton_available()
    batch = LoraBatch.build(torch.tensor([0]))
    assert batch is not None
    with pytest.raises(RuntimeError, match="needs Triton"):
        module.apply_lora_triton(torch.zeros(1, 4), torch.zeros(1, 4), batch,
                                 torch.zeros(1, 2, 4), torch.zeros(1, 4, 2))


def weights(num_slots: int, rank: int, in_features: int, out_features: int,
            seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lora_a = torch.randn(num_slots, rank, in_features, generator=g) / in_features ** 0.5
    lora_b = torch.randn(num_slots, out_features, rank, generator=g) / rank ** 0.5
    return lora_a.to(DEVICE), lora_b.to(DEVICE)


def check(slots: list[int], lora_a: torch.Tensor, lora_b: torch.Tensor,
          active_slots: frozenset[int] | None = None, seed: int = 0) -> torch.Tensor:
    """Runs both implementations on the same inputs (y starts non-zero: the add is in place),
    asserts they match and returns the Triton delta."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(slots), lora_a.shape[2], generator=g).to(DEVICE)
    y = torch.randn(len(slots), lora_b.shape[1], generator=g).to(DEVICE)
    batch = LoraBatch.build(torch.tensor(slots, device=DEVICE))
    assert batch is not None
    expected, got = y.clone(), y.clone()
    apply_lora_parts(expected, x, batch, lora_a, (lora_b,), active_slots)
    lora_triton.apply_lora_triton(got, x, batch, lora_a, lora_b, active_slots)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    return (got - y).cpu()


@kernel_test
@pytest.mark.parametrize(("rank", "in_features", "out_features"), [(16, 48, 80), (8, 72, 48), (96, 130, 32)])
def test_mixed_batch_matches_reference(rank: int, in_features: int, out_features: int) -> None:
    """Uneven segments, base tokens (-1) in between, slots out of token order. Ragged
    blocks everywhere: rank 8 is padded to the 16 of ``tl.dot``, rank 96 takes a full and a
    ragged 64-wide rank block, 72 and 130 inputs end in a ragged 64-wide reduction step,
    80 outputs in a ragged second column block."""
    slots = [2, -1, 0, 2, 3, 2, -1, 0, 2, 2, 3, -1, 2, 0, 2, 2, 1]
    delta = check(slots, *weights(4, rank, in_features, out_features, seed=rank))
    assert all(not delta[t].any() for t, s in enumerate(slots) if s < 0)
    assert all(delta[t].any() for t, s in enumerate(slots) if s >= 0)


@kernel_test
def test_unused_slot_and_one_long_segment() -> None:
    """Slot 1 has no token (no segment); slot 2's 70 tokens span two 64-row blocks while
    the other segments end in the first (their programs for the second block return)."""
    slots = [0, 3, *([2] * 35), -1, *([2] * 35), 3, 0]
    check(slots, *weights(4, 8, 32, 48, seed=1))


@kernel_test
def test_active_slots_skip_segments() -> None:
    slots = [0, 1, 2, -1, 1, 0, 2, 2, 1, 0]
    lora_a, lora_b = weights(3, 16, 32, 48, seed=2)
    delta = check(slots, lora_a, lora_b, active_slots=frozenset({0, 2}))
    assert all(not delta[t].any() for t, s in enumerate(slots) if s not in (0, 2))
    assert all(delta[t].any() for t, s in enumerate(slots) if s in (0, 2))
    assert not check(slots, lora_a, lora_b, active_slots=frozenset({7})).any()
    check(slots, lora_a, lora_b, active_slots=frozenset({0, 1, 2, 5}))


@kernel_test
def test_fused_projection_views_with_partial_rank() -> None:
    """A fused projection: adapters of rank 4 and 12 in a rank-16 layout (the unused rank
    rows and columns zero), ``x`` and ``y`` column slices of wider tensors (row strides
    differ from their widths), one slot of the stack never used."""
    lora_a, lora_b = weights(3, 16, 40, 56, seed=3)
    for slot, used in ((0, 4), (2, 12)):
        lora_a[slot, used:] = 0
        lora_b[slot, :, used:] = 0
    slots = [2, 0, -1, 0, 2, 2, 0, -1, 2, 0, 0]
    g = torch.Generator().manual_seed(4)
    x_wide = torch.randn(len(slots), 100, generator=g).to(DEVICE)
    y_wide = torch.randn(len(slots), 3 * 56, generator=g).to(DEVICE)
    x, expected_wide = x_wide[:, 30:70], y_wide.clone()
    batch = LoraBatch.build(torch.tensor(slots, device=DEVICE))
    assert batch is not None
    apply_lora_parts(expected_wide[:, 56:112], x, batch, lora_a, (lora_b,))
    got_wide = y_wide.clone()
    lora_triton.apply_lora_triton(got_wide[:, 56:112], x, batch, lora_a, lora_b)
    torch.testing.assert_close(got_wide, expected_wide, rtol=1e-4, atol=1e-4)
    assert torch.equal(got_wide[:, :56], y_wide[:, :56]) and torch.equal(got_wide[:, 112:], y_wide[:, 112:])


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA (the interpreter's bf16 is wrong)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_on_cuda(dtype: torch.dtype) -> None:
    """Half-precision inputs at model-like sizes against an fp32 computation of the same
    rounded inputs: the kernels accumulate in fp32 and round once."""
    lora_a, lora_b = weights(4, 16, 2048, 1024 + 40, seed=5)
    slots = torch.randint(-1, 4, (300,), generator=torch.Generator().manual_seed(6)).tolist()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(len(slots), 2048, generator=g).to(DEVICE, dtype)
    y = torch.randn(len(slots), 1024 + 40, generator=g).to(DEVICE, dtype)
    batch = LoraBatch.build(torch.tensor(slots, device=DEVICE))
    assert batch is not None
    expected = y.float()
    apply_lora_parts(expected, x.float(), batch, lora_a.to(dtype).float(), (lora_b.to(dtype).float(),))
    got = y.clone()
    lora_triton.apply_lora_triton(got, x, batch, lora_a.to(dtype), lora_b.to(dtype))
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


def python_batch(slots: list[int]) -> tuple[list[int], list[int], list[int], list[int]]:
    """token_indices, seg_starts, seg_lens, seg_slots computed with plain Python."""
    order = sorted((t for t, s in enumerate(slots) if s >= 0), key=lambda t: slots[t])  # sorted() is stable
    groups = [(slot, len(list(run))) for slot, run in itertools.groupby(slots[t] for t in order)]
    lens = [n for _, n in groups]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return order, starts, lens, [slot for slot, _ in groups]


@pytest.mark.parametrize("seed", range(5))
def test_lora_batch_build_invariants(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(-1, 4, (1 + 7 * seed,), generator=g).tolist()
    batch = LoraBatch.build(torch.tensor(slots))
    if all(s < 0 for s in slots):
        assert batch is None
        return
    assert batch is not None
    order, starts, lens, seg_slots = python_batch(slots)
    assert batch.token_indices.tolist() == order and batch.token_indices.dtype == torch.int64
    assert (batch.seg_starts, batch.seg_lens, batch.seg_slots) == (tuple(starts), tuple(lens), tuple(seg_slots))
    assert [t.tolist() for t in batch.seg_tensors] == [starts, lens, seg_slots]
    assert all(t.dtype == torch.int32 for t in batch.seg_tensors)
    assert batch.max_seg_len == max(lens) and min(lens) > 0


def test_all_base_tokens_build_no_batch() -> None:
    assert LoraBatch.build(torch.tensor([-1, -1, -1])) is None
