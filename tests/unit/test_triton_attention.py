"""The Triton attention backend (kernels/attention/triton_paged.py) against the torch
reference backend, and its place in the registry.

Both backends see identical inputs and identical caches (cached context already written,
never-written slots full of garbage) and run a whole step each (``prepare`` + ``forward``,
the cache write included); outputs and the caches after the write must agree.

Where the kernels run: on CUDA when there is a GPU (compiled, in this process); otherwise
on the CPU under Triton's interpreter, in fp32 and fp16 (its bf16 arithmetic is wrong).
As in ``test_lora_triton.py``, ``TRITON_INTERPRET`` must be set before anything imports
Triton, so ``test_kernels_on_the_interpreter`` runs this file again in a subprocess with
``TRITON_INTERPRET=1``. The interpreter runs programs one after another (a launch takes
0.1-1 s), so the shapes are small and each case packs several situations into one step.
"""

from __future__ import annotations

import importlib.util
import math
import random
import sys

import pytest
import torch

from refengine.config import KernelConfig
from refengine.kernels.attention import registry, triton_paged
from refengine.kernels.attention.base import AttentionMetadata
from refengine.kernels.attention.torch_ref import TorchReferenceBackend
from tests.triton_interpreter import (
    DEVICE,
    HAS_TRITON,
    INTERPRET,
    in_a_subprocess,
    kernel_test,
    requires_triton,
    run_interpreted,
)

pytestmark = pytest.mark.triton

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3}
GARBAGE = 50.0  # scale of never-written cache slots: reading one would show


@requires_triton
@in_a_subprocess
def test_kernels_on_the_interpreter() -> None:
    run_interpreted(__file__)


@kernel_test
def test_kernels_are_interpreted_or_compiled() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    assert triton_paged.triton_available()
    for kernel in (triton_paged.store_kv, triton_paged.paged_attention, triton_paged.combine_splits):
        assert isinstance(kernel, InterpretedFunction) == INTERPRET


# ----------------------------------------------------------------------------- a step, run by both backends


def make_step(shape: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
              dtype: torch.dtype, seed: int, kv_dtype: torch.dtype | None = None):
    """Sequences ``(context, new)``: ``context`` tokens already cached, ``new`` in this step.
    Block ids are shuffled (non-contiguous tables, spare blocks in between). Returns the
    metadata, q/k/v (``dtype``), the caches (``kv_dtype``, None = ``dtype``; context written,
    garbage elsewhere) and the scale."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    needed = [math.ceil((c + n) / block_size) for c, n in shape]
    num_blocks = sum(needed) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = [ids[sum(needed[:i]) : sum(needed[: i + 1])] for i in range(len(shape))]
    kv_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(kv_shape, generator=gen) * GARBAGE
    v_cache = torch.randn(kv_shape, generator=gen) * GARBAGE

    def slot(table: list[int], p: int) -> int:
        return table[p // block_size] * block_size + p % block_size

    for (context, _), table in zip(shape, tables, strict=True):  # the cached context, as earlier steps left it
        context_slots = torch.tensor([slot(table, p) for p in range(context)], dtype=torch.int64)
        for cache in (k_cache, v_cache):
            cache.view(-1, num_kv_heads, head_dim)[context_slots] = torch.randn(context, num_kv_heads, head_dim,
                                                                                generator=gen)
    block_tables = torch.zeros(len(shape), max(needed), dtype=torch.int64)
    for i, table in enumerate(tables):
        block_tables[i, : len(table)] = torch.tensor(table)
    slots = [slot(table, p) for (c, n), table in zip(shape, tables, strict=True) for p in range(c, c + n)]
    query_start_loc = [0]
    for _, n in shape:
        query_start_loc.append(query_start_loc[-1] + n)
    # q, k and v are views into one fused [T, heads + 2 * kv_heads, D] tensor, as the model passes them.
    qkv = torch.randn(query_start_loc[-1], num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    meta = AttentionMetadata(query_start_loc, [c + n for c, n in shape], block_tables.to(DEVICE),
                             torch.tensor(slots, dtype=torch.int64, device=DEVICE), block_size)
    kv_dtype = kv_dtype or dtype
    return meta, q, k, v, k_cache.to(DEVICE, kv_dtype), v_cache.to(DEVICE, kv_dtype), 1.0 / math.sqrt(head_dim)


def check_against_reference(shape: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
                            block_size: int, dtype: torch.dtype, seed: int = 0,
                            backend: triton_paged.TritonPagedBackend | None = None,
                            kv_dtype: torch.dtype | None = None) -> triton_paged.TritonPagedBackend:
    meta, q, k, v, k_cache, v_cache, scale = make_step(shape, num_heads, num_kv_heads, head_dim, block_size, dtype,
                                                       seed, kv_dtype)
    reference = TorchReferenceBackend()
    reference.prepare(meta)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    expected = reference.forward(q, k, v, ref_k, ref_v, scale)
    backend = backend or triton_paged.TritonPagedBackend()
    backend.prepare(meta)
    got = backend.forward(q, k, v, k_cache, v_cache, scale)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v), "the cache write differs"
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
    return backend


# A fresh prefill crossing a block boundary, a chunk continuing a cached context that
# crosses blocks, decode rows at a block's last row, its first row and mid-block.
RAGGED = [(0, 21), (19, 14), (15, 1), (16, 1), (40, 1)]


@kernel_test
@pytest.mark.parametrize(("dtype", "num_heads", "num_kv_heads", "head_dim", "block_size"), [
    (torch.float32, 2, 2, 64, 16),  # MHA (group 1)
    (torch.float16, 3, 1, 128, 32),  # group 3: padded to 4 heads per tile
    (torch.float32, 8, 1, 128, 16),  # group 8
    (torch.float16, 16, 2, 64, 32),  # group 8, two KV heads
    (torch.float32, 4, 2, 80, 16),  # head_dim 80, padded to 128 and masked
    (torch.float32, 4, 2, 8, 16),  # head_dim 8, padded to 16: tl.dot's least K on NVIDIA GPUs
], ids=["fp32-g1-d64-b16", "fp16-g3-d128-b32", "fp32-g8-d128-b16", "fp16-g8-d64-b32", "fp32-g2-d80-b16",
        "fp32-g2-d8-b16"])
def test_ragged_step_matches_reference(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                                       block_size: int) -> None:
    backend = check_against_reference(RAGGED, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=num_heads)
    assert backend.num_splits == 1  # a mixed step never splits on its own


@kernel_test
@pytest.mark.parametrize(("dtype", "num_heads", "num_kv_heads", "head_dim", "block_size"), [
    (torch.float32, 3, 1, 64, 16),
    (torch.float16, 8, 1, 128, 32),
], ids=["fp32-g3-d64-b16", "fp16-g8-d128-b32"])
def test_split_kv_decode_matches_reference(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                                           block_size: int) -> None:
    """Forced split-KV with 64-position partitions: a 300-position context takes 5 splits,
    the short sequence leaves the later splits empty (they must weigh nothing)."""
    backend = triton_paged.TritonPagedBackend(split_kv=True, partition_tokens=64)
    check_against_reference([(299, 1), (37, 1), (130, 1)], num_heads, num_kv_heads, head_dim, block_size, dtype,
                            seed=5, backend=backend)
    assert backend.num_splits == 5


@kernel_test
@pytest.mark.parametrize("launch", [
    triton_paged.LaunchConfig(block_n=16, num_warps=8, num_stages=2),
    triton_paged.LaunchConfig(block_n=128, num_warps=4, num_stages=4),
], ids=["n16-w8-s2", "n128-w4-s4"])
@pytest.mark.parametrize("split_kv", [False, True], ids=["one-pass", "split-kv"])
def test_launch_overrides_compute_the_same_attention(launch: triton_paged.LaunchConfig, split_kv: bool) -> None:
    """The tuning sweep's overrides (gpu_check.py) change the tile walk, not the result: a ragged
    step (one pass) and a forced split with partitions that are not whole 128-position tiles."""
    backend = triton_paged.TritonPagedBackend(split_kv=split_kv, partition_tokens=64, launch=launch)
    shape = [(299, 1), (37, 1), (130, 1)] if split_kv else RAGGED
    check_against_reference(shape, 6, 2, 64, 16, torch.float32, seed=11, backend=backend)


def test_launch_overrides_are_validated() -> None:
    for bad in ({"block_n": 48}, {"block_n": 8}, {"num_warps": 3}, {"num_stages": 0}):
        with pytest.raises(ValueError):
            triton_paged.LaunchConfig(**bad)


@kernel_test
@pytest.mark.parametrize("split_kv", [False, True], ids=["one-pass", "split-kv"])
def test_a_cache_in_another_dtype_matches_reference(split_kv: bool) -> None:
    """--kv-cache-dtype: float32 queries on a float16 cache. The write kernel rounds the step's
    keys and values into the cache exactly as the reference does (the caches stay equal), and
    attention reads them back to float32: the fp32 tolerance holds."""
    backend = triton_paged.TritonPagedBackend(split_kv=split_kv, partition_tokens=64)
    meta_shape = RAGGED if not split_kv else [(130, 1), (37, 1)]
    check_against_reference(meta_shape, 4, 2, 64, 16, torch.float32, seed=9, backend=backend, kv_dtype=torch.float16)
    assert backend.num_splits == (3 if split_kv else 1)


@kernel_test
def test_forced_split_on_a_mixed_step_matches_reference() -> None:
    backend = triton_paged.TritonPagedBackend(split_kv=True, partition_tokens=64)
    check_against_reference([(0, 21), (70, 9), (100, 1)], 4, 2, 64, 16, torch.float32, seed=6, backend=backend)
    assert backend.num_splits == 2


@kernel_test
def test_the_heuristic_splits_a_long_decode_context() -> None:
    """A decode-only step past ``SPLIT_KV_MIN_BLOCKS`` blocks splits on its own (and matches)."""
    block_size = 16
    long = triton_paged.SPLIT_KV_MIN_BLOCKS * block_size + 5
    backend = check_against_reference([(long - 1, 1), (20, 1)], 2, 1, 64, block_size, torch.float32, seed=7)
    assert backend.num_splits == math.ceil(long / triton_paged.PARTITION_TOKENS) > 1


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA (the interpreter's bf16 is wrong)")
def test_bf16_and_a_larger_step_on_cuda() -> None:
    """bf16, model-like heads (SmolLM2: 9 heads / 3 KV heads, head_dim 64), a long prefill
    chunk over several query tiles, and a long decode context on the split heuristic."""
    shape = [(0, 300), (700, 130), *[(n, 1) for n in (5, 511, 512, 2000)]]
    meta, q, k, v, k_cache, v_cache, scale = make_step(shape, 9, 3, 64, 16, torch.bfloat16, seed=8)
    reference = TorchReferenceBackend()
    reference.prepare(meta)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    expected = reference.forward(q.float(), k.float(), v.float(), ref_k.float(), ref_v.float(), scale)
    backend = triton_paged.TritonPagedBackend()
    backend.prepare(meta)
    got = backend.forward(q, k, v, k_cache, v_cache, scale)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)
    check_against_reference([(2000, 1), (3000, 1)], 9, 3, 64, 16, torch.float32, seed=9)


def meta_for(shape: list[tuple[int, int]], block_size: int) -> AttentionMetadata:
    starts = [0]
    for _, n in shape:
        starts.append(starts[-1] + n)
    return AttentionMetadata(starts, [c + n for c, n in shape], torch.zeros(len(shape), 1, dtype=torch.int64),
                             torch.zeros(starts[-1], dtype=torch.int64), block_size)


@pytest.mark.parametrize(("shape", "block_size", "splits"), [
    ([(1024, 1)], 16, 3),  # 1025 positions = 65 blocks of 16 > 64: ceil(1025 / 512) = 3 splits
    ([(1023, 1), (5, 1)], 16, 1),  # exactly 64 blocks: no split
    ([(1030, 1), (5, 1)], 16, 3),  # 65 blocks: ceil(1031 / 512) = 3 splits
    ([(2047, 1)], 32, 1),  # 64 blocks of 32
    ([(4000, 1)], 32, 8),  # 126 blocks of 32: 8 splits of 512
    ([(20000, 1)], 16, triton_paged.MAX_KV_SPLITS),  # capped
    ([(1030, 2)], 16, 1),  # not decode-only: never splits on its own
    ([(1030, 1), (0, 7)], 16, 1),
])
def test_split_kv_heuristic(shape: list[tuple[int, int]], block_size: int, splits: int) -> None:
    num_splits, partition = triton_paged.split_kv_plan(meta_for(shape, block_size))
    assert num_splits == splits
    if splits > 1:
        longest = max(c + n for c, n in shape)
        assert partition % 64 == 0 and (num_splits - 1) * partition < longest <= num_splits * partition
    assert triton_paged.split_kv_plan(meta_for(shape, block_size), force=False) == (1, 0)
    num_splits, partition = triton_paged.split_kv_plan(meta_for(shape, block_size), tile=128)
    if num_splits > 1:  # a wider tile: partitions of whole 128-position tiles that still cover the context
        assert partition % 128 == 0 and (num_splits - 1) * partition < longest <= num_splits * partition


# ----------------------------------------------------------------------------- CUDA graph mode


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_graph_mode_computes_the_eager_decode_step_bit_for_bit(dtype: torch.dtype) -> None:
    """Graph mode reads the fixed buffers (``triton_graph_buffers.py``) that ``prepare_for_replay``
    filled, with the launch shapes of the eager decode-only step: the same output and cache
    writes, bit for bit, after a stale eager step (whose tensors it must not read)."""
    shape = [(15, 1), (16, 1), (40, 1)]  # decode rows at a block's last row, its first row, mid-block
    meta, q, k, v, k_cache, v_cache, scale = make_step(shape, 6, 2, 64, 16, dtype, seed=5)
    eager = triton_paged.TritonPagedBackend()
    eager.prepare(meta)
    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    want = eager.forward(q, k, v, eager_k, eager_v, scale)
    graphed = triton_paged.TritonPagedBackend()
    graphed.init_cuda_graph_state(4, 8, device=DEVICE)
    stale = make_step([(0, 5), (3, 2)], 6, 2, 64, 16, dtype, seed=6)[0]
    graphed.prepare(stale)
    graphed.prepare_for_capture(3)
    graphed.prepare_for_replay(meta)
    got = graphed.forward(q, k, v, k_cache, v_cache, scale)
    assert torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v), "the cache write differs"
    assert torch.equal(got, want)


def test_a_step_the_eager_path_would_split_runs_eagerly() -> None:
    """Graphs are captured unsplit: a decode step whose longest context the eager path would
    split (more than SPLIT_KV_MIN_BLOCKS blocks) is ineligible, as is every step with
    ``split_kv=True``; shorter ones may replay."""
    backend = triton_paged.TritonPagedBackend()
    short = [16 * triton_paged.SPLIT_KV_MIN_BLOCKS, 7]
    assert backend.graph_step_ineligible_reason(short, 16) == ""
    assert "split" in backend.graph_step_ineligible_reason([16 * triton_paged.SPLIT_KV_MIN_BLOCKS + 1, 7], 16)
    assert "split" in triton_paged.TritonPagedBackend(split_kv=True).graph_step_ineligible_reason(short, 16)
    assert triton_paged.TritonPagedBackend().supports_cuda_graphs


# ----------------------------------------------------------------------------- registry and imports


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_without_cuda_triton_is_unavailable_and_auto_unchanged(dtype: torch.dtype) -> None:
    kernels = KernelConfig()
    why = registry.choose_backend("auto", dtype, "cpu", kernels)[1]
    assert why.index("flashinfer: ") < why.index("triton: "), why  # CUDA backends first: auto prefers them
    for device in ("cpu", "cuda"):
        reason = registry.unavailable_reason("triton", dtype, device, kernels)
        assert reason and ("needs CUDA" in reason or "CUDA is not available" in reason or "not installed" in reason)
        with pytest.raises(ValueError, match="attention backend 'triton' is unavailable"):
            registry.make_attention_backend("triton", dtype, device, kernels)
    assert "TRITON_INTERPRET" in registry.unavailable_reason("triton", dtype, "cpu", kernels)
    available = registry.available_backends(dtype, "cpu", kernels)
    assert "triton" not in available
    chosen = registry.make_attention_backend("auto", dtype, "cpu", kernels)
    assert type(chosen) is type(registry.make_attention_backend(available[0], dtype, "cpu", kernels))


def test_availability_needs_a_supported_dtype() -> None:
    reason = triton_paged.unavailable_reason(torch.float64, "cuda")
    assert reason  # float64: refused (or no CUDA / no Triton here)
    if HAS_TRITON and torch.cuda.is_available():
        assert "float16, bfloat16 or float32" in reason
        assert triton_paged.unavailable_reason(torch.bfloat16, "cuda") == ""


def test_without_triton_the_module_imports_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """A private copy of the module loaded with ``import triton`` failing (a CPU-only install)."""
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.spec_from_file_location("_triton_paged_without_triton", triton_paged.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    assert not module.triton_available()
    assert module.unavailable_reason(torch.float16, "cuda") == "triton is not installed"
    with pytest.raises(RuntimeError, match="needs Triton"):
        module.TritonPagedBackend()


def test_versions_older_than_the_gpu_image_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels target the GPU machines' torch 2.11 / Triton 3.6 and newer; older ones are named."""
    from refengine.kernels.attention import triton_paged

    assert triton_paged._version("2.13.0+cpu") == (2, 13) and triton_paged._version("3.6.0") == (3, 6)
    monkeypatch.setattr(triton_paged.torch, "__version__", "2.10.1")
    assert "torch 2.10.1 (needs >= 2.11)" in triton_paged.stack_too_old()
    monkeypatch.setattr(triton_paged.torch, "__version__", "2.11.0")
    assert triton_paged.stack_too_old() == "" or "triton" in triton_paged.stack_too_old()


@kernel_test
def test_token_offsets_past_2_to_the_31_elements() -> None:
    """Queries a row stride of 1.6e9 elements apart (a view into a huge fused QKV output): token 2
    starts 3.2e9 elements in, past int32, which the kernels' token offsets were (found by review: a
    segfault here; on a GPU, a store to a wrapped offset). Only three rows of the 6.4 GB view are
    touched."""
    heads, kv_heads, head_dim, block_size, tokens = 2, 1, 16, 16, 3
    stride = 3 * 2**29  # < 2**31: Triton passes it as int32; token 2's offset is not
    try:
        big = torch.empty(stride * (tokens - 1) + heads * head_dim, dtype=torch.float16, device=DEVICE)
    except (RuntimeError, MemoryError) as exc:  # a machine that cannot reserve 6.4 GB of address space
        pytest.skip(f"cannot reserve the 6.4 GB view: {exc}")
    q = big.as_strided((tokens, heads, head_dim), (stride, head_dim, 1))
    generator = torch.Generator().manual_seed(0)
    for t in range(tokens):
        q[t] = torch.randn(heads, head_dim, generator=generator).half().to(DEVICE)
    k = torch.randn(tokens, kv_heads, head_dim, generator=generator).half().to(DEVICE)
    v = torch.randn(tokens, kv_heads, head_dim, generator=generator).half().to(DEVICE)
    k_cache = torch.zeros(2, block_size, kv_heads, head_dim, dtype=torch.float16, device=DEVICE)
    meta = AttentionMetadata([0, tokens], [tokens], torch.tensor([[1]], device=DEVICE),
                             torch.tensor([16, 17, 18], device=DEVICE), block_size)
    reference = TorchReferenceBackend()
    reference.prepare(meta)
    want = reference.forward(q, k, v, k_cache.clone(), k_cache.clone(), head_dim ** -0.5)
    backend = triton_paged.TritonPagedBackend()
    backend.prepare(meta)
    got = backend.forward(q, k, v, k_cache.clone(), k_cache.clone(), head_dim ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[torch.float16], rtol=0)
