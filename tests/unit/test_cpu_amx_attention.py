"""The AMX form of the CPU attention kernel (``kernels/cpu/paged_attention_amx.h``): bfloat16
queries on a bfloat16 cache, scored and summed on AMX tiles, with its own cache layout.

Oracles: the float64 dense attention of test_cpu_paged_attention.py (and the torch reference in
bf16), and the invariants every CPU form keeps, checked bit for bit: a row's result does not
depend on its batch, on how its prompt was chunked, on whether it came as a decode row, nor on
the thread count. Here a decode row of a GQA group of 1 or 3 is weighed row by row and a prompt
row lane by lane (``amx_weights``): the chunking tests compare the two."""

from __future__ import annotations

import math

import pytest
import torch

from refengine.kernels.attention import TorchReferenceBackend, make_attention_backend
from refengine.kernels.attention.cpu_paged import CpuPagedBackend, amx_form_available
from tests.unit.test_cpu_paged_attention import (
    MIXED,
    NUM_KV_HEADS,
    SeqData,
    assert_thread_count_invariant,
    float32_outputs,
    make_meta,
    make_seq,
    make_seqs,
    max_error_vs_oracle,
    run_steps,
)

pytestmark = [pytest.mark.threads(2),
              pytest.mark.skipif(not amx_form_available(),
                                 reason="no AMX form here (the CPU lacks amx_bf16, or the library was built without "
                                        "it, or Linux refused the AMX state)")]
BF16 = torch.bfloat16


def amx_backend() -> CpuPagedBackend:
    return CpuPagedBackend(BF16, BF16)


def count_amx_calls(backend: CpuPagedBackend) -> list[int]:
    calls, kernel = [], backend._amx_kernel  # noqa: SLF001 - the test watches the kernel the backend chose
    backend._amx_kernel = lambda *args: calls.append(1) or kernel(*args)  # noqa: SLF001
    return calls


@pytest.mark.parametrize("head_dim", [64, 128, 96, 32, 256])  # 256: the most 32-dimension steps
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [16, 32, 64, 256])  # 256: a key tile is one block
def test_matches_the_oracle(head_dim, group, block_size) -> None:
    """Within bf16's rounding of the float64 oracle and of the torch reference in bf16, on MIXED
    (decode rows, chunks after a context, prompts over two key tiles); unwritten slots hold garbage."""
    seqs = make_seqs(MIXED, NUM_KV_HEADS * group, head_dim, seed=head_dim + group + block_size)
    backend = amx_backend()
    calls = count_amx_calls(backend)
    native = run_steps(backend, seqs, block_size, seed=block_size, dtype=BF16)
    assert len(calls) == 2  # the context step and the step under test ran on the AMX form
    assert max_error_vs_oracle(seqs, native) <= 0.05
    reference = run_steps(TorchReferenceBackend(), seqs, block_size, seed=block_size, dtype=BF16)
    for a, b in zip(native.new_out, reference.new_out, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=0.04, rtol=0)


def test_other_head_dims_keep_the_vector_form() -> None:
    """head_dim 80 is not whole 32-dimension steps: the cache keeps the vector forms' layout and
    their kernel runs."""
    backend = amx_backend()
    calls = count_amx_calls(backend)
    k_shape, v_shape = backend.kv_cache_shapes(10, 16, NUM_KV_HEADS, 80)
    assert k_shape == (10, NUM_KV_HEADS, 80, 16) and v_shape == (10, 16, NUM_KV_HEADS, 80)
    seqs = make_seqs([(20, 1), (0, 9)], NUM_KV_HEADS * 3, 80, seed=3)
    assert max_error_vs_oracle(seqs, run_steps(backend, seqs, 16, seed=1, dtype=BF16)) <= 0.05
    assert not calls


def test_only_bf16_on_bf16_takes_it() -> None:
    """The layout is chosen at construction from the dtypes the backend will be given; the
    registry passes both (the AMX form reads bf16 queries and a bf16 cache only)."""
    for dtype, kv_dtype in ((torch.float32, None), (BF16, torch.float32), (torch.float32, BF16)):
        assert CpuPagedBackend(dtype, kv_dtype).kv_cache_shapes(4, 16, 2, 64)[0] == (4, 2, 64, 16)
    made = make_attention_backend("cpu", BF16, "cpu", kv_dtype=BF16)
    assert made.kv_cache_shapes(4, 16, 2, 64) == ((4, 16, 2, 64), (4, 2, 64, 16))


@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_never_reads_unwritten_slots(block_size) -> None:
    """Unwritten slots full of NaN never reach an output: the value pass copies the item's last
    positions with zeros past them (0 x NaN is NaN), and scores past them are masked."""
    seqs = make_seqs(MIXED, NUM_KV_HEADS * 3, 64, seed=5)
    results = run_steps(amx_backend(), seqs, block_size, seed=2, fill=float("nan"), dtype=BF16)
    assert max_error_vs_oracle(seqs, results) <= 0.05


def test_the_layout_has_its_own_name() -> None:
    """Engines compare KV layout strings before moving blocks (disaggregation). Where num_kv_heads
    == head_dim == block_size the two CPU layouts have the same shapes: the names tell them apart."""
    from refengine.model.kv_io import KvBlockIO

    layouts = []
    for backend in (amx_backend(), CpuPagedBackend()):
        k_shape, v_shape = backend.kv_cache_shapes(4, 32, 32, 32)
        layouts.append(KvBlockIO([(torch.zeros(k_shape, dtype=BF16), torch.zeros(v_shape, dtype=BF16))],
                                 backend.kv_layout_name(32, 32)).layout)
    assert layouts[0] != layouts[1]
    assert amx_backend().kv_layout_name(80, 16) == CpuPagedBackend().kv_layout_name(64, 16)  # both the vector layout


def test_a_float32_call_on_its_layout_is_refused() -> None:
    """The AMX kernel would read float32 as bf16: the layout was made for bf16 on bf16."""
    backend = amx_backend()
    k_shape, v_shape = backend.kv_cache_shapes(4, 16, NUM_KV_HEADS, 64)
    backend.prepare(make_meta([[1]], [3], [3], 16))
    q, k, v = torch.randn(3, NUM_KV_HEADS, 64), torch.randn(3, NUM_KV_HEADS, 64), torch.randn(3, NUM_KV_HEADS, 64)
    with pytest.raises(TypeError, match="for bf16 queries on a bf16 cache"):
        backend.forward(q, k, v, torch.zeros(k_shape, dtype=BF16), torch.zeros(v_shape, dtype=BF16), 0.125)


def test_cache_layout() -> None:
    """Keys row-major [block, position, kv head, dim], values transposed [block, kv head, dim,
    position]: every written token reads back from where the layout says, nothing else changes."""
    block_size, head_dim, num_blocks = 16, 64, 12
    backend = amx_backend()
    k_shape, v_shape = backend.kv_cache_shapes(num_blocks, block_size, NUM_KV_HEADS, head_dim)
    k_cache, v_cache = torch.randn(k_shape).to(BF16), torch.randn(v_shape).to(BF16)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    tables = [[7, 2], [5]]
    meta = make_meta(tables, [3, 9], [20, 9], block_size)
    num_tokens = len(meta.slot_mapping)
    q = torch.randn(num_tokens, NUM_KV_HEADS * 3, head_dim).to(BF16)
    k, v = (torch.randn(num_tokens, NUM_KV_HEADS, head_dim).to(BF16) for _ in range(2))
    backend.prepare(meta)
    backend.forward(q, k, v, k_cache, v_cache, 1.0 / math.sqrt(head_dim))
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for t, slot in enumerate(meta.slot_mapping.tolist()):
        block, offset = divmod(slot, block_size)
        assert torch.equal(k_cache[block, offset], k[t])
        assert torch.equal(v_cache[block, :, :, offset], v[t])
        written[block, offset] = True
    assert torch.equal(k_cache[~written], k_before[~written])
    assert torch.equal(v_cache.permute(0, 3, 1, 2)[~written], v_before.permute(0, 3, 1, 2)[~written])


def test_batch_invariance() -> None:
    """A sequence's rows are bitwise the same alone or amid others, wherever its blocks lie."""
    seqs = make_seqs(MIXED, NUM_KV_HEADS * 3, 64, seed=11)
    batched = run_steps(amx_backend(), seqs, 16, seed=1, dtype=BF16)
    for i, s in enumerate(seqs):
        alone = run_steps(amx_backend(), [s], 16, seed=100 + i, spare_blocks=5, dtype=BF16)
        assert torch.equal(alone.new_out[0], batched.new_out[i]), f"sequence {i} {(s.context, s.new)}"
        if s.context:
            assert torch.equal(alone.context_out[0], batched.context_out[i]), f"context of sequence {i}"


def float32_rows(cached: int, seq: SeqData, block_size: int, seed: int) -> torch.Tensor:
    """Every query row's float32 output (both steps, in position order), as the kernel wrote it,
    before the backend's rounding to bf16 could hide a difference."""
    backend, captured = amx_backend(), []
    backend._amx_kernel = float32_outputs(backend._amx_kernel, captured)  # noqa: SLF001
    split = SeqData(cached, seq.new - cached, seq.k, seq.v, seq.q_new[:cached], seq.q_new[cached:])
    run_steps(backend, [split], block_size, seed=seed, dtype=BF16)
    return torch.cat(captured)


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_rows_do_not_depend_on_the_chunking(group, block_size) -> None:
    """300 prompt tokens as one chunk, or two steps cut after 1, 120, 256 (the first key tile's
    end) or 299 (the last row as a decode row: weighed row by row where the group is 1 or 3, lane
    by lane in the prompt): every row's float32 output bitwise the same."""
    whole = make_seq(0, 300, NUM_KV_HEADS * group, 64, seed=21)
    whole.q_new.mul_(4.0)  # weights over a wide range, so that a softmax sum in another order would round otherwise
    one_chunk = float32_rows(0, whole, block_size, seed=7)
    assert one_chunk.abs().max() > 0
    for cut in (1, 120, 256, 299):
        assert torch.equal(float32_rows(cut, whole, block_size, seed=8 + cut), one_chunk), f"cut at {cut}"


def test_thread_count_invariance() -> None:
    assert_thread_count_invariant(amx_backend, BF16)
