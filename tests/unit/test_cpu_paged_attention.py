"""The native CPU attention backend against an independent dense oracle, and the kernel loader.

The oracle never touches a backend: each sequence's keys and values are kept as plain
dense ``[seq_len, num_kv_heads, head_dim]`` tensors, and attention is written out in
float64 (GQA by repeating KV heads, causal mask by position). The backends only see
the paged cache, filled the way the engine fills it: a first step writes the cached
context (a prefill of it), a second step brings the new queries.
"""

from __future__ import annotations

import ctypes
import math
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from refengine.config import KernelConfig
from refengine.kernels import cpu
from refengine.kernels.attention import TorchReferenceBackend, make_attention_backend, registry
from refengine.kernels.attention.base import AttentionBackend, AttentionMetadata
from refengine.kernels.attention.cpu_paged import (
    BF16_QUERY_KERNELS,
    CpuPagedBackend,
    bf16_query_form,
    bf16_query_kernels,
    choose_bf16_query_form,
    native_kernel_unavailable_reason,
)
from refengine.kernels.cpu_features import cpu_flags, native_bf16
from tests.unit.kernel_helpers import forget_loaded_kernels

_REASON = native_kernel_unavailable_reason()
pytestmark = [pytest.mark.threads(2),  # the work split between threads (tests/conftest.py)
              pytest.mark.skipif(bool(_REASON), reason=f"native CPU attention kernel unavailable: {_REASON}")]

NUM_KV_HEADS = 2
TOLERANCE = 1e-4
GARBAGE = 50.0  # scale of the random values in never-written cache slots: a leak would show


# ----------------------------------------------------------------------------- helpers


@dataclass
class SeqData:
    """One sequence: ``context`` cached tokens, then ``new`` tokens in the step under test."""

    context: int
    new: int
    k: torch.Tensor  # [context + new, num_kv_heads, head_dim], dense, position order
    v: torch.Tensor
    q_context: torch.Tensor  # [context, num_heads, head_dim]: the queries of the step that cached the context
    q_new: torch.Tensor  # [new, num_heads, head_dim]

    @property
    def total(self) -> int:
        return self.context + self.new


def make_seq(context: int, new: int, num_heads: int, head_dim: int, seed: int) -> SeqData:
    gen = torch.Generator().manual_seed(seed)
    total = context + new
    return SeqData(
        context, new,
        k=torch.randn(total, NUM_KV_HEADS, head_dim, generator=gen),
        v=torch.randn(total, NUM_KV_HEADS, head_dim, generator=gen),
        q_context=torch.randn(context, num_heads, head_dim, generator=gen),
        q_new=torch.randn(new, num_heads, head_dim, generator=gen),
    )


def make_seqs(shape: list[tuple[int, int]], num_heads: int, head_dim: int, seed: int = 0) -> list[SeqData]:
    return [make_seq(context, new, num_heads, head_dim, seed * 1000 + i) for i, (context, new) in enumerate(shape)]


def oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense causal attention in float64: q [L, H, D] are the last L positions of k/v [S, KVH, D]."""
    query_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    keys = k.double().repeat_interleave(group, dim=1)  # query head h reads KV head h // group
    values = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.double(), keys) * scale
    query_pos = torch.arange(seq_len - query_len, seq_len)
    future = torch.arange(seq_len)[None, :] > query_pos[:, None]  # [L, S]
    scores = scores.masked_fill(future[None], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("hls,shd->lhd", weights, values)


def assign_blocks(seqs: list[SeqData], block_size: int, spare: int, rng: random.Random) -> tuple[list[list[int]], int]:
    """Shuffled block ids for every sequence, with ``spare`` blocks nobody owns mixed in."""
    needed = [math.ceil(s.total / block_size) for s in seqs]
    num_blocks = sum(needed) + spare
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in needed:
        tables.append(ids[at : at + n])
        at += n
    return tables, num_blocks


def make_meta(
    tables: list[list[int]], query_lens: list[int], seq_lens: list[int], block_size: int
) -> AttentionMetadata:
    max_blocks = max(len(t) for t in tables)
    block_tables = torch.zeros(len(tables), max_blocks, dtype=torch.int64)  # padded with 0, as documented
    slots = []
    for i, table in enumerate(tables):
        block_tables[i, : len(table)] = torch.tensor(table)
        for p in range(seq_lens[i] - query_lens[i], seq_lens[i]):
            slots.append(table[p // block_size] * block_size + p % block_size)
    query_start_loc = [0]
    for n in query_lens:
        query_start_loc.append(query_start_loc[-1] + n)
    return AttentionMetadata(query_start_loc, list(seq_lens), block_tables, torch.tensor(slots, dtype=torch.int64),
                             block_size)


@dataclass
class StepResults:
    context_out: list[torch.Tensor | None]  # per sequence: output rows of the context step (None: no context)
    new_out: list[torch.Tensor]  # per sequence: output rows of the step under test
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def run_steps(
    backend: AttentionBackend, seqs: list[SeqData], block_size: int, *, seed: int = 0, spare_blocks: int = 3,
    fill: float | None = None, dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None,
) -> StepResults:
    """Drives ``backend`` through two steps using only ``kv_cache_shapes``, ``prepare`` and ``forward``:
    a prefill of every sequence's cached context, then every sequence's new tokens in one batch.
    Queries, keys and values are ``dtype``, the cache ``kv_dtype`` (None = ``dtype``).
    Never-written cache slots hold random garbage (or ``fill``)."""
    rng = random.Random(seed)
    tables, num_blocks = assign_blocks(seqs, block_size, spare_blocks, rng)
    head_dim = seqs[0].k.shape[-1]
    scale = 1.0 / math.sqrt(head_dim)
    k_shape, v_shape = backend.kv_cache_shapes(num_blocks, block_size, NUM_KV_HEADS, head_dim)
    gen = torch.Generator().manual_seed(seed + 1)
    if fill is None:
        k_cache = torch.randn(k_shape, generator=gen) * GARBAGE
        v_cache = torch.randn(v_shape, generator=gen) * GARBAGE
    else:
        k_cache, v_cache = torch.full(k_shape, fill), torch.full(v_shape, fill)
    k_cache, v_cache = k_cache.to(kv_dtype or dtype), v_cache.to(kv_dtype or dtype)

    context_out: list[torch.Tensor | None] = [None] * len(seqs)
    cached = [i for i, s in enumerate(seqs) if s.context]
    if cached:
        meta = make_meta([tables[i] for i in cached], [seqs[i].context for i in cached],
                         [seqs[i].context for i in cached], block_size)
        backend.prepare(meta)
        out = backend.forward(
            torch.cat([seqs[i].q_context for i in cached]).to(dtype),
            torch.cat([seqs[i].k[: seqs[i].context] for i in cached]).to(dtype),
            torch.cat([seqs[i].v[: seqs[i].context] for i in cached]).to(dtype),
            k_cache, v_cache, scale,
        )
        for j, i in enumerate(cached):
            context_out[i] = out[meta.query_start_loc[j] : meta.query_start_loc[j + 1]]

    meta = make_meta(tables, [s.new for s in seqs], [s.total for s in seqs], block_size)
    backend.prepare(meta)
    out = backend.forward(
        torch.cat([s.q_new for s in seqs]).to(dtype),
        torch.cat([s.k[s.context :] for s in seqs]).to(dtype),
        torch.cat([s.v[s.context :] for s in seqs]).to(dtype),
        k_cache, v_cache, scale,
    )
    new_out = [out[meta.query_start_loc[i] : meta.query_start_loc[i + 1]] for i in range(len(seqs))]
    return StepResults(context_out, new_out, k_cache, v_cache)


def max_error_vs_oracle(seqs: list[SeqData], results: StepResults) -> float:
    """The largest |output - oracle|; a NaN or infinity anywhere fails (Python's ``max`` would
    skip a NaN error)."""
    worst = 0.0
    for s, context_out, new_out in zip(seqs, results.context_out, results.new_out, strict=True):
        scale = 1.0 / math.sqrt(s.k.shape[-1])
        assert torch.isfinite(new_out).all() and (context_out is None or torch.isfinite(context_out).all())
        if s.context:
            expected = oracle(s.q_context, s.k[: s.context], s.v[: s.context], scale)
            worst = max(worst, (context_out.double() - expected).abs().max().item())
        expected = oracle(s.q_new, s.k, s.v, scale)
        assert new_out.shape == expected.shape
        worst = max(worst, (new_out.double() - expected).abs().max().item())
    return worst


# ----------------------------------------------------------------------------- batches

LONG = 64  # where shapes the chunk kernel refuses once switched from the row kernel to SDPA
# (context, new) per sequence.
DECODE_ONLY = [(0, 1), (1, 1), (7, 1), (15, 1), (16, 1), (17, 1), (40, 1), (97, 1)]
MIXED = [
    (40, 1),  # decode rows ...
    (LONG + 5, 1),
    (20, 13),  # short chunks continuing a cached context, crossing block boundaries
    (16, 16),  # context ending exactly on a block boundary
    (3, 1),
    (0, 5),  # short fresh prompts
    (0, LONG - 1),
    (0, LONG),  # ... and long ones
    (0, LONG + 9),
    (37, LONG),  # long chunks continuing a context
    (16, LONG + 3),
    (0, 300),  # more than one of the chunk kernel's key tiles (256 positions) ...
    (250, 40),  # ... with the chunk straddling the first key tile's end
    (9, 1),
]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.mark.parametrize("block_size", [16, 32, 8, 1])  # 8 and 1: the chunk kernel refuses them (row kernel)
@pytest.mark.parametrize("head_dim", [64, 128, 80, 40])  # 80: the chunk kernel's 16-wide tail; 40: row kernel
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("batch", [DECODE_ONLY, MIXED], ids=["decode_only", "mixed"])
def test_matches_dense_oracle_and_reference(batch, group, head_dim, block_size) -> None:
    num_heads = NUM_KV_HEADS * group
    seqs = make_seqs(batch, num_heads, head_dim, seed=group * 7 + head_dim + block_size)
    native = run_steps(CpuPagedBackend(), seqs, block_size, seed=block_size)
    assert max_error_vs_oracle(seqs, native) <= TOLERANCE

    # The torch reference on the same inputs (its own cache layout, same block tables).
    reference = run_steps(TorchReferenceBackend(), seqs, block_size, seed=block_size)
    assert max_error_vs_oracle(seqs, reference) <= TOLERANCE
    for a, b in zip(native.new_out, reference.new_out, strict=True):
        torch.testing.assert_close(a, b, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("block_size", [16, 8])  # 16: the chunk kernel; 8: the row kernel
@pytest.mark.parametrize(("num_heads", "q_head_dim"), [(3, 64), (6, 64), (4, 32)], ids=["3of4", "6of4", "dim32of64"])
def test_queries_that_do_not_fit_the_cache_raise(num_heads: int, q_head_dim: int, block_size: int) -> None:
    """Query heads not a multiple of the cache's KV heads, or of another size than its heads, are a
    ValueError; the kernels once returned rows never written (or read past the KV heads) instead."""
    backend, kv_heads, head_dim = CpuPagedBackend(), 4, 64
    k_shape, v_shape = backend.kv_cache_shapes(2, block_size, kv_heads, head_dim)
    backend.prepare(make_meta([[0, 1]], [5], [5], block_size))
    q = torch.randn(5, num_heads, q_head_dim)
    k, v = torch.randn(5, kv_heads, head_dim), torch.randn(5, kv_heads, head_dim)
    with pytest.raises(ValueError, match="query heads must be a multiple of KV heads"):
        backend.forward(q, k, v, torch.zeros(k_shape), torch.zeros(v_shape), 0.125)


def backend_for(form: str | None) -> CpuPagedBackend:
    """The backend, with bf16 queries on a bf16 cache computed by ``form`` (a name of
    BF16_QUERY_KERNELS), or (None) widened to float32 per step and scored by the float32 kernel,
    as on a library built without AVX-512."""
    backend = CpuPagedBackend()
    kernels = bf16_query_kernels(cpu.load("paged_attention").library)
    if form is not None and form not in kernels:
        pytest.skip(f"the attention library was built without the {form} form (vdpbf16ps needs AVX512-BF16)")
    backend._bf16_query_kernel = kernels[form] if form else None  # noqa: SLF001 - the test's switch
    return backend


@pytest.mark.skipif(not native_bf16(), reason="this CPU has no native bf16 (avx512_bf16 / amx_bf16)")
@pytest.mark.parametrize("form", [*BF16_QUERY_KERNELS, None], ids=["vdpbf16ps", "multiply-adds", "widened"])
@pytest.mark.parametrize("head_dim", [64, 128, 96, 80, 40])  # 96: a 32-wide value pass; 80: a 16-wide tail
@pytest.mark.parametrize("block_size", [16, 32, 8])
def test_bfloat16_cache_matches_the_oracle(head_dim, block_size, form) -> None:
    """bf16 keys and values read by the kernel with float32 accumulation: within bf16's rounding
    of the inputs (and the output) of the float64 oracle, and of the torch reference in bf16.
    Every way of computing with bf16 queries: vdpbf16ps pairs (scores, and values by pairs of
    positions under bf16 weights), the same by float32 multiply-adds, and queries widened to float32."""
    seqs = make_seqs(MIXED, NUM_KV_HEADS * 3, head_dim, seed=head_dim + block_size)
    native = run_steps(backend_for(form), seqs, block_size, seed=block_size, dtype=torch.bfloat16)
    assert all(out.dtype == torch.bfloat16 for out in native.new_out)
    assert max_error_vs_oracle(seqs, native) <= 0.05
    reference = run_steps(TorchReferenceBackend(), seqs, block_size, seed=block_size, dtype=torch.bfloat16)
    for a, b in zip(native.new_out, reference.new_out, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=0.04, rtol=0)


@pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="this CPU has no avx512_bf16")
def test_bf16_queries_on_a_bf16_cache_take_the_bf16_query_kernel() -> None:
    """On an AVX512-BF16 CPU the library is built with both bf16-query forms, and the backend
    sends bf16 queries on a bf16 cache to the chosen one (as bf16: the kernel reads q's own bits);
    float32 queries on a bf16 cache are not exact bf16 and keep the float32 kernel."""
    backend = CpuPagedBackend()
    assert backend._bf16_query_kernel is not None  # noqa: SLF001
    calls = []
    kernel = backend._bf16_query_kernel  # noqa: SLF001

    def counted(*args):  # noqa: ANN002, ANN202
        calls.append(args)
        return kernel(*args)

    backend._bf16_query_kernel = counted  # noqa: SLF001
    seqs = make_seqs([(20, 1), (0, 9)], NUM_KV_HEADS * 3, 64, seed=4)
    run_steps(backend, seqs, 16, seed=2, dtype=torch.bfloat16)
    assert len(calls) == 2  # the context step and the step under test
    run_steps(backend, seqs, 16, seed=2, dtype=torch.float32, kv_dtype=torch.bfloat16)
    assert len(calls) == 2


def float32_outputs(kernel, captured: list[torch.Tensor]):  # noqa: ANN001, ANN201
    """``kernel`` (a chunk kernel entry point) recording each call's float32 output, before the
    backend rounds it to bfloat16. Its arguments: out, q, caches, block tables, query_start_loc
    (5), seq_lens, seq_ids, num_selected (8), num_heads (9), num_kv_heads, head_dim (11), ..."""

    def run(*args):  # noqa: ANN002, ANN202
        status = kernel(*args)
        num_tokens = (ctypes.c_int32 * (args[8] + 1)).from_address(args[5])[args[8]]
        values = (ctypes.c_float * (num_tokens * args[9] * args[11])).from_address(args[0])
        captured.append(torch.frombuffer(values, dtype=torch.float32).clone())
        return status

    return run


def both_bf16_query_forms() -> dict:
    kernels = bf16_query_kernels(cpu.load("paged_attention").library)
    if len(kernels) < 2:
        pytest.skip(f"the attention library was built with {sorted(kernels) or 'no'} bf16-query form(s), not both "
                    "(vdpbf16ps needs AVX512-BF16)")
    return kernels


@pytest.mark.parametrize("tiny_values", [False, True], ids=["normal", "tiny"])
@pytest.mark.parametrize("head_dim", [64, 128, 96, 80])  # 96: a 32-wide value pass; 80: a 16-wide tail
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_bf16_query_forms_give_the_same_bits(block_size, group, head_dim, tiny_values) -> None:
    """chunk_attention_bf16q (vdpbf16ps) and chunk_attention_bf16qf (float32 multiply-adds in
    vdpbf16ps's order: per pair, the odd element's product first) give the same float32 outputs,
    bit for bit, so the backend may take whichever is faster here. With ``tiny_values`` the
    first 16 dimensions of every value are denormal (about 1e-39), which vdpbf16ps reads as zero,
    and the next 16 are +-2^-125, normal, but their products with the softmax weights and their
    running sums (of random signs) are often denormal, which vdpbf16ps flushes to zero. The
    multiply-adds run under DAZ and FTZ: without DAZ this test fails. (FTZ alone is not seen at
    the outputs: under DAZ every denormal result is read as zero at its next use, as here each is.)"""
    seqs = make_seqs(MIXED, NUM_KV_HEADS * group, head_dim, seed=head_dim + group)
    for seq in seqs:
        if tiny_values:
            seq.v[..., :16] *= 1e-39
            seq.v[..., 16:32] = seq.v[..., 16:32].sign() * 2.0**-125
    outputs = {}
    for name, kernel in both_bf16_query_forms().items():
        backend, outputs[name] = CpuPagedBackend(), []
        backend._bf16_query_kernel = float32_outputs(kernel, outputs[name])  # noqa: SLF001 - the test's switch
        run_steps(backend, seqs, block_size, seed=block_size, dtype=torch.bfloat16)
    dots, fmas = (outputs[name] for name in BF16_QUERY_KERNELS)
    assert len(dots) == len(fmas) == 2  # the context step and the step under test
    for by_dots, by_fmas in zip(dots, fmas, strict=True):
        assert by_dots.abs().max() > 0
        assert torch.equal(by_dots, by_fmas), f"{(by_dots != by_fmas).sum()} of {by_dots.numel()} outputs differ"


def test_vdpbf16ps_is_kept_unless_clearly_slower() -> None:
    """With both forms built the measured speed decides, and says so; with one, that one runs."""
    both = list(BF16_QUERY_KERNELS)
    assert choose_bf16_query_form(both, 0.5).name == "float32 multiply-adds"
    assert "0.50x the rate of float32 multiply-adds" in choose_bf16_query_form(both, 0.5).why
    assert choose_bf16_query_form(both, 0.8).name == choose_bf16_query_form(both, 1.9).name == "vdpbf16ps"
    assert choose_bf16_query_form(["float32 multiply-adds"], 2.0).name == "float32 multiply-adds"
    assert choose_bf16_query_form([], 2.0) is None


def test_the_backend_takes_the_chosen_bf16_query_form() -> None:
    """bf16_query_form names a form the library has, says why, and is what the backend runs."""
    form = bf16_query_form()
    kernels = bf16_query_kernels(cpu.load("paged_attention").library)
    if form is None:
        assert not kernels
        pytest.skip("the attention library has no bf16-query form (no AVX-512)")
    assert form.name in kernels and form.why
    if len(kernels) == 2:
        assert "x the rate of float32 multiply-adds" in form.why
    assert CpuPagedBackend()._bf16_query_kernel is kernels[form.name]  # noqa: SLF001


#: (query dtype, cache dtype): each cache dtype's kernels, and bf16 queries.
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)]
DTYPE_PAIR_IDS = ["float32", "bfloat16", "float16-cache"]


@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize(("dtype", "kv_dtype"), DTYPE_PAIRS, ids=DTYPE_PAIR_IDS)
@pytest.mark.parametrize("backend", [CpuPagedBackend, TorchReferenceBackend])
def test_never_reads_unwritten_slots(backend, block_size, dtype, kv_dtype) -> None:
    """Unwritten slots full of NaN (partial last blocks, spare blocks) must not reach any output
    (a freed block keeps what its last owner wrote, NaN included). SDPA's masked positions still
    meet their values (0 x NaN), so the SDPA paths must not be passed them at all; in bf16 the
    native value pass goes by pairs of positions, and a block's odd last position must not pair
    with the NaN after it (MIXED has odd lengths)."""
    if dtype == torch.bfloat16 and backend is CpuPagedBackend and not native_bf16():
        pytest.skip("this CPU has no native bf16 (avx512_bf16 / amx_bf16)")
    seqs = make_seqs(MIXED, NUM_KV_HEADS * 3, 64, seed=5)
    results = run_steps(backend(), seqs, block_size, seed=2, fill=float("nan"), dtype=dtype, kv_dtype=kv_dtype)
    assert max_error_vs_oracle(seqs, results) <= (TOLERANCE if dtype == kv_dtype == torch.float32 else 0.05)


def test_large_scores_stay_finite() -> None:
    """Scores of a few hundred overflow a float32 exp unless each softmax subtracts its row maximum."""
    seqs = make_seqs([(30, 1), (20, 7), (0, 9)], NUM_KV_HEADS * 2, 64, seed=9)
    for s in seqs:
        s.q_context.mul_(60.0)
        s.q_new.mul_(60.0)
    results = run_steps(CpuPagedBackend(), seqs, 16, seed=6)
    assert all(torch.isfinite(out).all() for out in results.new_out)
    # Peaked softmaxes amplify float32 rounding of the scores, hence the looser bound.
    assert max_error_vs_oracle(seqs, results) <= 1e-3


def test_single_block_context_and_one_token_sequences() -> None:
    """Edge sizes: a lone first token, a context shorter than one block, a context of exactly one block."""
    seqs = make_seqs([(0, 1), (1, 1), (0, 2), (15, 1), (16, 1), (1, 2)], NUM_KV_HEADS * 4, 128, seed=3)
    results = run_steps(CpuPagedBackend(), seqs, 16, seed=4)
    assert max_error_vs_oracle(seqs, results) <= TOLERANCE


# ----------------------------------------------------------------------------- batch invariance


@pytest.mark.parametrize(("head_dim", "dtype"), [(64, torch.float32), (40, torch.float32), (64, torch.bfloat16)])
def test_batch_invariance(head_dim, dtype) -> None:
    """A sequence's output rows are bitwise the same alone or amid others, wherever its blocks lie."""
    if dtype == torch.bfloat16 and not native_bf16():
        pytest.skip("this CPU has no native bf16 (avx512_bf16 / amx_bf16)")
    seqs = make_seqs(MIXED, NUM_KV_HEADS * 3, head_dim, seed=11)
    batched = run_steps(CpuPagedBackend(), seqs, 16, seed=1, dtype=dtype)
    for i, s in enumerate(seqs):
        alone = run_steps(CpuPagedBackend(), [s], 16, seed=100 + i, spare_blocks=5, dtype=dtype)
        assert torch.equal(alone.new_out[0], batched.new_out[i]), f"sequence {i} {(s.context, s.new)}"
        if s.context:
            assert torch.equal(alone.context_out[0], batched.context_out[i]), f"context of sequence {i}"


@pytest.mark.parametrize(("dtype", "kv_dtype"), DTYPE_PAIRS, ids=DTYPE_PAIR_IDS)
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (40, 16), (64, 8)],
                         ids=["chunk-kernel", "row-kernel-dim40", "row-kernel-block8"])
def test_rows_do_not_depend_on_the_chunking(group, dtype, kv_dtype, head_dim, block_size) -> None:
    """A prompt of 300 tokens as one chunk, or cut into two steps: after 1 (a one-token prompt),
    120, 256 (the first key tile's end) or 299 (the last row as a decode step). Every row is
    bitwise the same: the chunk kernel's key tiles start at absolute positions and a vector's
    arithmetic depends neither on its tile mates nor on the tile's width; shapes it refuses take
    the row kernel for every row (they once took SDPA for chunks of 64 rows or more, whose result
    depended on the chunk's length: 1 ulp apart, found by review)."""
    if dtype == torch.bfloat16 and not native_bf16():
        pytest.skip("this CPU has no native bf16 (avx512_bf16 / amx_bf16)")
    whole = make_seq(0, 300, NUM_KV_HEADS * group, head_dim, seed=21)
    one_chunk = run_steps(CpuPagedBackend(), [whole], block_size, seed=7, dtype=dtype, kv_dtype=kv_dtype).new_out[0]
    for cut in (1, 120, 256, 299):
        split = SeqData(cut, 300 - cut, whole.k, whole.v, whole.q_new[:cut], whole.q_new[cut:])
        two_steps = run_steps(CpuPagedBackend(), [split], block_size, seed=8 + cut, dtype=dtype, kv_dtype=kv_dtype)
        assert torch.equal(two_steps.context_out[0], one_chunk[:cut]), f"first chunk, cut at {cut}"
        assert torch.equal(two_steps.new_out[0], one_chunk[cut:]), f"second chunk, cut at {cut}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_thread_count_invariance(dtype) -> None:
    """Work is split by query row (row kernel) or tile of query vectors (chunk kernel), each
    computed whole by one thread, so the thread count cannot change any row's arithmetic."""
    if dtype == torch.bfloat16 and not native_bf16():
        pytest.skip("this CPU has no native bf16 (avx512_bf16 / amx_bf16)")
    assert_thread_count_invariant(CpuPagedBackend, dtype)


def assert_thread_count_invariant(make_backend, dtype: torch.dtype) -> None:  # noqa: ANN001
    """MIXED on 1 thread and on the test's threads, through fresh backends: every row bitwise equal."""
    seqs = make_seqs(MIXED, NUM_KV_HEADS * 4, 128, seed=12)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run_steps(make_backend(), seqs, 16, seed=3, dtype=dtype)
    finally:
        torch.set_num_threads(threads)
    multi = run_steps(make_backend(), seqs, 16, seed=3, dtype=dtype)
    for i, (a, b) in enumerate(zip(single.new_out, multi.new_out, strict=True)):
        assert torch.equal(a, b), f"sequence {i} {MIXED[i]}"


# ----------------------------------------------------------------------------- the cache write


def read_token(k_cache: torch.Tensor, v_cache: torch.Tensor, slot: int, block_size: int):
    """A token's key and value read back through CpuPagedBackend's documented layout:
    keys ``[num_blocks, num_kv_heads, head_dim, block_size]``, values ``[num_blocks, block_size, kv_heads, dim]``."""
    block, offset = divmod(slot, block_size)
    return k_cache[block, :, :, offset], v_cache[block, offset]


@pytest.mark.parametrize("block_size", [16, 8, 1])
def test_cache_write_layout_and_untouched_blocks(block_size) -> None:
    num_heads, head_dim = NUM_KV_HEADS * 2, 64
    backend = CpuPagedBackend()
    num_blocks = 64 // block_size + 40
    k_shape, v_shape = backend.kv_cache_shapes(num_blocks, block_size, NUM_KV_HEADS, head_dim)
    assert k_shape == (num_blocks, NUM_KV_HEADS, head_dim, block_size)
    assert v_shape == (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(k_shape, generator=gen), torch.randn(v_shape, generator=gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()

    # Three sequences (a decode row, a chunk continuing a context, a long fresh prompt) on shuffled blocks.
    rng = random.Random(block_size)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    shape = [(10, 1), (5, 12), (0, LONG + 3)]
    tables, at = [], 0
    for context, new in shape:
        n = math.ceil((context + new) / block_size)
        tables.append(ids[at : at + n])
        at += n
    meta = make_meta(tables, [n for _, n in shape], [c + n for c, n in shape], block_size)
    num_tokens = len(meta.slot_mapping)
    # q, k, v as non-contiguous views of one fused projection, as the model passes them.
    qkv = torch.randn(num_tokens, (num_heads + 2 * NUM_KV_HEADS) * head_dim, generator=gen)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + NUM_KV_HEADS) * head_dim].view(num_tokens, NUM_KV_HEADS, head_dim)
    v = qkv[:, (num_heads + NUM_KV_HEADS) * head_dim :].view(num_tokens, NUM_KV_HEADS, head_dim)
    assert not k.is_contiguous() and not v.is_contiguous()
    backend.prepare(meta)
    out = backend.forward(q, k, v, k_cache, v_cache, 1.0 / math.sqrt(head_dim))
    assert out.shape == q.shape and torch.isfinite(out).all()

    written_k = torch.zeros(k_shape, dtype=torch.bool)
    written_v = torch.zeros(v_shape, dtype=torch.bool)
    for t, slot in enumerate(meta.slot_mapping.tolist()):
        key, value = read_token(k_cache, v_cache, slot, block_size)
        assert torch.equal(key, k[t]) and torch.equal(value, v[t]), f"token {t} at slot {slot}"
        block, offset = divmod(slot, block_size)
        written_k[block, :, :, offset] = True
        written_v[block, offset] = True
    assert torch.equal(k_cache[~written_k], k_before[~written_k])
    assert torch.equal(v_cache[~written_v], v_before[~written_v])
    touched = set((meta.slot_mapping // block_size).tolist())
    for block in set(range(num_blocks)) - touched:
        assert torch.equal(k_cache[block], k_before[block]) and torch.equal(v_cache[block], v_before[block])


# ----------------------------------------------------------------------------- choosing a backend


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """An empty kernel cache dir, and the loader's memo cleared before and after."""
    monkeypatch.setenv("REFENGINE_CACHE_DIR", str(tmp_path / "cache"))
    forget_loaded_kernels()
    yield tmp_path / "cache"
    forget_loaded_kernels()  # runs before monkeypatch restores the environment; the next load() looks again


def test_make_attention_backend_choices() -> None:
    assert type(make_attention_backend("torch", torch.float32, "cpu")) is TorchReferenceBackend
    assert type(make_attention_backend("auto", torch.float32, "cpu")) is CpuPagedBackend
    assert type(make_attention_backend("cpu", torch.float32, "cpu")) is CpuPagedBackend
    bf16 = CpuPagedBackend if native_bf16() else TorchReferenceBackend
    assert type(make_attention_backend("auto", torch.bfloat16, "cpu")) is bf16
    assert type(make_attention_backend("auto", torch.float16, "cpu")) is TorchReferenceBackend
    assert type(make_attention_backend("auto", torch.float32, "cuda")) is TorchReferenceBackend
    with pytest.raises(ValueError, match="float32"):
        make_attention_backend("cpu", torch.float16, "cpu")


def test_bfloat16_needs_native_bf16(monkeypatch) -> None:
    """Where the CPU lacks bf16 dot products the native kernel is not chosen for bfloat16."""
    monkeypatch.setattr(registry, "native_bf16", lambda: False)
    assert type(make_attention_backend("auto", torch.bfloat16, "cpu")) is TorchReferenceBackend
    with pytest.raises(ValueError, match="native bf16"):
        make_attention_backend("cpu", torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_attention_backend("flash", torch.float32, "cpu")


def test_no_compiler_falls_back(fresh_loader, monkeypatch, tmp_path) -> None:
    empty = tmp_path / "empty_bin"
    empty.mkdir()
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("PATH", str(empty))  # hides gcc too: _compiler() falls back to which("gcc")
    forget_loaded_kernels()
    loaded = cpu.load("paged_attention")
    assert loaded.library is None
    assert "compiler" in loaded.reason
    assert "compiler" in native_kernel_unavailable_reason()
    assert type(make_attention_backend("auto", torch.float32, "cpu")) is TorchReferenceBackend
    with pytest.raises(ValueError, match="compiler"):
        make_attention_backend("cpu", torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="compiler"):
        CpuPagedBackend()
    assert not (fresh_loader / "kernels").exists()


def test_disabled_by_kernel_config(fresh_loader) -> None:
    """KernelConfig.native_cpu_kernels = False: nothing is built, auto takes the reference,
    and naming the native backend is an error that says which switch turned it off."""
    off = KernelConfig(native_cpu_kernels=False)
    loaded = cpu.load("paged_attention", enabled=False)
    assert loaded.library is None and "--no-native-kernels" in loaded.reason
    assert "native_cpu_kernels" in native_kernel_unavailable_reason(enabled=False)
    assert type(make_attention_backend("auto", torch.float32, "cpu", off)) is TorchReferenceBackend
    with pytest.raises(ValueError, match="--no-native-kernels"):
        make_attention_backend("cpu", torch.float32, "cpu", off)
    assert not (fresh_loader / "kernels").exists()  # not even attempted
    # The switch is per call, not process-wide (the loader's own test: fused_ops builds in a
    # fraction of a second, paged_attention in about 4).
    assert cpu.load("fused_ops").library is not None


def test_build_is_cached(fresh_loader) -> None:
    """The loader builds once and finds the build again; fused_ops.c (quick to build) stands for any kernel."""
    first = cpu.load("fused_ops")
    assert first.library is not None and first.reason == ""
    assert cpu.load("fused_ops") is first  # memoized within the process
    path = Path(first.library._name)
    assert path.name == "libfused_ops.so" and path.exists()
    assert path.parent.parent == fresh_loader / "kernels"
    assert len(path.parent.name) == 16 and all(c in "0123456789abcdef" for c in path.parent.name)
    # the temporary build files were renamed, nothing left over: the library and its digest
    assert sorted(path.parent.iterdir()) == [path, path.with_name("libfused_ops.so.sha256")]
    built = path.stat().st_mtime_ns

    forget_loaded_kernels()
    second = cpu.load("fused_ops")  # a new process would do this: finds the built library
    assert second.library is not None and Path(second.library._name) == path
    assert path.stat().st_mtime_ns == built  # not rebuilt


def test_built_library_is_readable_by_everyone(fresh_loader) -> None:
    """The built library is mode 0755, as a compiler's output is, so that other users of a shared
    cache can load it (built under mkstemp's name, it was 0711: executable but not readable)."""
    path = Path(cpu.load("fused_ops").library._name)
    assert path.stat().st_mode & 0o777 == 0o755


def test_unwritable_cache_falls_back(fresh_loader, monkeypatch, tmp_path) -> None:
    """A cache dir that cannot be created (here: under a regular file) is a reason, not a crash."""
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    monkeypatch.setenv("REFENGINE_CACHE_DIR", str(blocker / "cache"))
    forget_loaded_kernels()
    loaded = cpu.load("paged_attention")
    assert loaded.library is None and "could not build or load" in loaded.reason
    assert type(make_attention_backend("auto", torch.float32, "cpu")) is TorchReferenceBackend


def test_failed_build_leaves_nothing_behind(fresh_loader, monkeypatch) -> None:
    monkeypatch.setenv("CC", "/bin/false")  # a "compiler" that always fails
    forget_loaded_kernels()
    loaded = cpu.load("paged_attention")
    assert loaded.library is None and "failed to build paged_attention.c" in loaded.reason
    assert [p for p in (fresh_loader / "kernels").rglob("*") if p.is_file()] == []
