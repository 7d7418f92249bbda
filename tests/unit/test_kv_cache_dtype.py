"""--kv-cache-dtype: a KV cache in another dtype than the queries (issue 15).

Oracle: the float64 dense attention of tests/unit/test_cpu_paged_attention.py over keys and
values *rounded to the cache dtype*. A backend that computes in float32 over a 16-bit cache
must match it to float32 accuracy, also for the rows whose keys come from the step itself
(fresh prompts, the SDPA path): they are rounded as a later chunk would read them back, so a
prompt's result does not depend on its chunking. Against the unrounded oracle the same
backend is off by the 16-bit rounding, far above that tolerance: the test tells the two apart.
"""

from __future__ import annotations

import argparse
import platform
from dataclasses import replace

import pytest
import torch

from refengine.args import add_engine_args
from refengine.args_config import engine_config_from_args
from refengine.config import CacheConfig, EngineConfig, KernelConfig
from refengine.kernels import cpu
from refengine.kernels.attention import TorchReferenceBackend, make_attention_backend, registry
from refengine.kernels.attention.cpu_paged import CpuPagedBackend, native_kernel_unavailable_reason
from refengine.model.kv_io import KvBlockIO
from refengine.model.runner import ModelRunner, kv_bytes_per_block
from tests.tiny_models import hf_weights, make_tiny_hf_model, model_config_from_hf
from tests.unit.kernel_helpers import forget_loaded_kernels
from tests.unit.test_cpu_paged_attention import (
    MIXED,
    NUM_KV_HEADS,
    TOLERANCE,
    SeqData,
    make_seqs,
    max_error_vs_oracle,
    run_steps,
)

pytestmark = pytest.mark.threads(2)  # the work split between threads (tests/conftest.py)

NATIVE = native_kernel_unavailable_reason()
needs_native = pytest.mark.skipif(bool(NATIVE), reason=f"native CPU attention kernel unavailable: {NATIVE}")


def rounded(seqs: list[SeqData], kv_dtype: torch.dtype) -> list[SeqData]:
    """The sequences with keys and values as a ``kv_dtype`` cache holds them."""
    return [replace(s, k=s.k.to(kv_dtype).float(), v=s.v.to(kv_dtype).float()) for s in seqs]


@pytest.mark.parametrize(("backend", "kv_dtype"), [
    (TorchReferenceBackend, torch.bfloat16),
    (TorchReferenceBackend, torch.float16),
    pytest.param(CpuPagedBackend, torch.bfloat16, marks=needs_native),
    pytest.param(CpuPagedBackend, torch.float16, marks=needs_native),
], ids=["torch-bf16", "torch-fp16", "cpu-bf16", "cpu-fp16"])
@pytest.mark.parametrize("block_size", [16, 8])
def test_float32_queries_on_a_16_bit_cache_match_the_rounded_oracle(backend, kv_dtype, block_size) -> None:
    seqs = make_seqs(MIXED, NUM_KV_HEADS * 3, 64, seed=block_size)
    results = run_steps(backend(), seqs, block_size, seed=block_size, kv_dtype=kv_dtype)
    assert results.k_cache.dtype == results.v_cache.dtype == kv_dtype
    assert all(out.dtype == torch.float32 for out in results.new_out)
    assert max_error_vs_oracle(rounded(seqs, kv_dtype), results) <= TOLERANCE
    assert max_error_vs_oracle(seqs, results) > 10 * TOLERANCE  # the rounding is real, and visible


@needs_native
def test_bf16_queries_on_a_float32_cache() -> None:
    """The other pairing: bf16 compute, float32 cache (the native kernel takes bf16 queries
    widened to float32): within bf16's rounding of the oracle, like the all-bf16 path."""
    seqs = make_seqs(MIXED, NUM_KV_HEADS * 3, 64, seed=3)
    results = run_steps(CpuPagedBackend(), seqs, 16, dtype=torch.bfloat16, kv_dtype=torch.float32)
    assert results.k_cache.dtype == torch.float32
    assert all(out.dtype == torch.bfloat16 for out in results.new_out)
    assert max_error_vs_oracle(seqs, results) <= 0.05


@needs_native
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_native_and_reference_backends_agree_on_a_16_bit_cache(kv_dtype) -> None:
    seqs = make_seqs(MIXED, NUM_KV_HEADS * 2, 128, seed=11)
    native = run_steps(CpuPagedBackend(), seqs, 16, kv_dtype=kv_dtype)
    reference = run_steps(TorchReferenceBackend(), seqs, 16, kv_dtype=kv_dtype)
    for a, b in zip(native.new_out, reference.new_out, strict=True):
        torch.testing.assert_close(a, b, atol=TOLERANCE, rtol=0)


@needs_native
@pytest.mark.parametrize("value_scale", [1e-6, 1e4], ids=["subnormal", "large"])
@pytest.mark.parametrize("block_size", [16, 8])  # 16: the chunk kernel; 8: the row kernel
def test_a_float16_cache_reads_subnormal_and_large_values_exactly(block_size, value_scale) -> None:
    """float16's range widens exactly: keys and values ~1e-6 are all float16 subnormals (under
    2^-14: a conversion that flushed them would read 0), ~1e4 near its 65,504 maximum. Queries of
    the inverse size keep the scores ordinary; the output must be the rounded oracle's to float32
    accuracy, relative to the values' scale."""
    seqs = make_seqs(MIXED, NUM_KV_HEADS * 3, 64, seed=13)
    for s in seqs:
        s.k.mul_(value_scale)
        s.v.mul_(value_scale)
        s.q_context.div_(value_scale)
        s.q_new.div_(value_scale)
    oracle = rounded(seqs, torch.float16)
    if value_scale < 1:
        assert max(s.v.abs().max().item() for s in oracle) < 2.0 ** -14  # every value is subnormal
    results = run_steps(CpuPagedBackend(), seqs, block_size, seed=3, kv_dtype=torch.float16)
    assert max_error_vs_oracle(oracle, results) <= TOLERANCE * value_scale


@pytest.fixture
def avx2_library(monkeypatch: pytest.MonkeyPatch, tmp_path):  # noqa: ANN201
    """The attention library built for AVX2 (``-march=x86-64-v3``), in a fresh cache: the generic
    vector forms of the 16-bit loads, which CPUs without AVX-512 run (this one would take the
    AVX-512 forms). At -O1: their results, not their speed, are tested (2 s to build, not 10).
    Skips where the compiler cannot target it."""
    if platform.machine() != "x86_64":
        pytest.skip("the generic forms are built here by targeting x86-64-v3")
    monkeypatch.setenv("REFENGINE_CACHE_DIR", str(tmp_path / "cache"))
    flags = {"-march=native": "-march=x86-64-v3", "-O3": "-O1"}
    monkeypatch.setattr(cpu, "COMPILE_FLAGS", tuple(flags.get(f, f) for f in cpu.COMPILE_FLAGS))
    forget_loaded_kernels()
    library = cpu.load("paged_attention")
    if library.library is None:
        pytest.skip(f"the library does not build for x86-64-v3 here: {library.reason}")
    yield library.library
    forget_loaded_kernels()  # before the environment is restored: the next load() looks again


@needs_native
def test_the_generic_vector_forms_read_16_bit_caches(avx2_library) -> None:
    """Built without AVX-512, bfloat16 widens by a vector shift and float16 by the compiler's
    _Float16 conversion: the same rounded-oracle accuracy on both kernels (chunk and row)."""
    assert avx2_library.chunk_attention_bf16qf_available() == 0  # built without AVX-512 indeed
    assert avx2_library.paged_attention_f16_available() == 1  # GCC 12+ has _Float16 on x86-64
    for kv_dtype in (torch.bfloat16, torch.float16):
        for block_size in (16, 8):
            seqs = make_seqs(MIXED, NUM_KV_HEADS * 3, 64, seed=block_size)
            results = run_steps(CpuPagedBackend(), seqs, block_size, seed=block_size, kv_dtype=kv_dtype)
            assert max_error_vs_oracle(rounded(seqs, kv_dtype), results) <= TOLERANCE, (kv_dtype, block_size)


# ----------------------------------------------------------------------------- choosing a backend


def test_auto_picks_a_backend_that_reads_the_cache_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native kernel reads float32, bfloat16 and float16 caches on any CPU (16-bit ones widen by
    a shift or an exact conversion); auto takes the torch reference for a float16 cache only where
    the compiler had no ``_Float16`` to build those kernels with, and says so."""
    kernels = KernelConfig()
    with pytest.raises(ValueError, match="reads a float32, bfloat16 or float16 KV cache, not torch.float64"):
        make_attention_backend("cpu", torch.float32, "cpu", kernels, kv_dtype=torch.float64)
    if NATIVE:
        return
    for kv_dtype in (torch.bfloat16, torch.float16):
        assert type(make_attention_backend("auto", torch.float32, "cpu", kernels, kv_dtype=kv_dtype)) \
            is CpuPagedBackend
    monkeypatch.setattr(registry, "float16_cache_available", lambda: False)
    fp16 = make_attention_backend("auto", torch.float32, "cpu", kernels, kv_dtype=torch.float16)
    assert type(fp16) is TorchReferenceBackend
    with pytest.raises(ValueError, match="compiler without _Float16: no float16 KV cache kernels"):
        make_attention_backend("cpu", torch.float32, "cpu", kernels, kv_dtype=torch.float16)


def test_flashinfer_needs_the_cache_in_the_query_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """FlashInfer's paged fp16/bf16 kernels read the cache in the query dtype: another cache
    dtype makes it unavailable, naming why (checked with FlashInfer otherwise available)."""
    from refengine.kernels.attention import flashinfer_backend

    monkeypatch.setattr(flashinfer_backend, "flashinfer_unavailable_reason", lambda dtype, device: "")
    kernels = KernelConfig()
    reason = registry.unavailable_reason("flashinfer", torch.bfloat16, "cuda", kernels, kv_dtype=torch.float32)
    assert reason == "it needs the KV cache in the query dtype torch.bfloat16, not torch.float32"
    assert registry.unavailable_reason("flashinfer", torch.bfloat16, "cuda", kernels) == ""


# ----------------------------------------------------------------------------- configuration and capacity


def test_the_setting_and_its_flag() -> None:
    assert EngineConfig().kv_dtype == "float32"  # auto = --dtype
    assert EngineConfig(dtype="bfloat16").kv_dtype == "bfloat16"
    assert EngineConfig(kv_cache_dtype="float16").kv_dtype == "float16"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--kv-cache-dtype", "bfloat16"])).kv_cache_dtype == "bfloat16"
    assert engine_config_from_args(parser.parse_args([])).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp8"])


def test_a_16_bit_cache_holds_twice_the_blocks_in_the_same_memory() -> None:
    hf = make_tiny_hf_model()
    config, weights = model_config_from_hf(hf), hf_weights(hf)
    cache = CacheConfig(block_size=16, kv_memory_bytes=64 * kv_bytes_per_block(config, 16, torch.float32))
    full = ModelRunner(config, weights, cache, 256)
    half = ModelRunner(config, weights, cache, 256, kv_dtype=torch.bfloat16)
    assert (full.num_blocks, half.num_blocks) == (64, 128)
    assert {k.dtype for k, _ in half.kv_caches} == {v.dtype for _, v in half.kv_caches} == {torch.bfloat16}
    # What a prefill engine's KvSessionRef says (K9) and a decode engine checks against its own.
    assert KvBlockIO(half.kv_caches, "torch").dtype == "bfloat16"


def test_a_kv_budget_smaller_than_one_block_is_refused() -> None:
    """Found by review: the pool was one block whatever the budget (``--kv-memory-mib 1
    --block-size 64`` allocated three times the budget, without a word)."""
    hf = make_tiny_hf_model()
    config, weights = model_config_from_hf(hf), hf_weights(hf)
    block_bytes = kv_bytes_per_block(config, 16, torch.float32)
    assert ModelRunner(config, weights, CacheConfig(block_size=16, kv_memory_bytes=block_bytes), 256).num_blocks == 1
    with pytest.raises(ValueError, match="--kv-memory-mib .* holds no KV block of 16 tokens"):
        ModelRunner(config, weights, CacheConfig(block_size=16, kv_memory_bytes=block_bytes - 1), 256)
    counted = CacheConfig(block_size=16, num_blocks=1, kv_memory_bytes=1)  # --num-kv-blocks: the budget is unused
    assert ModelRunner(config, weights, counted, 256).num_blocks == 1
