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
from dataclasses import replace

import pytest
import torch

from refengine.args import add_engine_args
from refengine.args_config import engine_config_from_args
from refengine.config import CacheConfig, EngineConfig, KernelConfig
from refengine.kernels.attention import TorchReferenceBackend, make_attention_backend, registry
from refengine.kernels.attention.cpu_paged import CpuPagedBackend, native_kernel_unavailable_reason
from refengine.model.kv_io import KvBlockIO
from refengine.model.runner import ModelRunner, kv_bytes_per_block
from tests.tiny_models import hf_weights, make_tiny_hf_model, model_config_from_hf
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
], ids=["torch-bf16", "torch-fp16", "cpu-bf16"])
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
def test_the_native_and_reference_backends_agree_on_a_bf16_cache() -> None:
    seqs = make_seqs(MIXED, NUM_KV_HEADS * 2, 128, seed=11)
    native = run_steps(CpuPagedBackend(), seqs, 16, kv_dtype=torch.bfloat16)
    reference = run_steps(TorchReferenceBackend(), seqs, 16, kv_dtype=torch.bfloat16)
    for a, b in zip(native.new_out, reference.new_out, strict=True):
        torch.testing.assert_close(a, b, atol=TOLERANCE, rtol=0)


# ----------------------------------------------------------------------------- choosing a backend


def test_auto_picks_a_backend_that_reads_the_cache_dtype() -> None:
    kernels = KernelConfig()
    fp16 = make_attention_backend("auto", torch.float32, "cpu", kernels, kv_dtype=torch.float16)
    assert type(fp16) is TorchReferenceBackend  # the native kernel reads float32 and bfloat16 caches only
    with pytest.raises(ValueError, match="reads a float32 or bfloat16 KV cache, not torch.float16"):
        make_attention_backend("cpu", torch.float32, "cpu", kernels, kv_dtype=torch.float16)
    if not NATIVE:  # bf16 caches under float32 queries: the native kernel, on any CPU (it widens by a shift)
        assert type(make_attention_backend("auto", torch.float32, "cpu", kernels, kv_dtype=torch.bfloat16)) \
            is CpuPagedBackend


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
