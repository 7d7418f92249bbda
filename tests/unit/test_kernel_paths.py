"""Which kernels run, and why, as the engine reports them at start-up and in ServerInfo.extra."""

from __future__ import annotations

import logging

import pytest

from refengine.config import EngineConfig, KernelConfig
from refengine.engine.info import kernel_paths
from refengine.kernels import cpu_features


def test_auto_names_the_backend_and_the_ones_skipped() -> None:
    backend, why, bf16 = kernel_paths(EngineConfig())
    assert backend in ("cpu", "torch") and why.startswith("auto") and "needs CUDA" in why and bf16 == ""
    backend, why, _ = kernel_paths(EngineConfig(attention_backend="torch"))
    assert (backend, why) == ("torch", "named by --attention-backend")


@pytest.mark.parametrize("flags", [frozenset({"avx512f", "amx_bf16"}), frozenset({"avx2", "fma"})])
def test_bf16_on_cpu_says_which_path_and_warns_without_native_bf16(flags, monkeypatch, caplog) -> None:
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: flags)
    native = "amx_bf16" in flags
    with caplog.at_level(logging.INFO, logger="refengine.engine.info"):
        _, _, bf16 = kernel_paths(EngineConfig(dtype="bfloat16"))
    assert bf16.startswith("native bf16 (amx_bf16)" if native else "no native bf16")
    record = next(r for r in caplog.records if "bfloat16 on CPU" in r.getMessage())
    assert record.levelno == (logging.INFO if native else logging.WARNING)
    if native:  # the AMX GEMM where it builds and runs (the flags are forced), else oneDNN saying why not
        from refengine.kernels import amx_gemm

        reason = amx_gemm.unavailable_reason()
        assert ("projections in the native AMX GEMM" if not reason else f"projections in oneDNN ({reason})") in bf16


def test_bf16_on_avx512_bf16_without_amx_names_the_native_gemm(monkeypatch) -> None:
    from refengine.kernels import native_gemm

    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    _, _, bf16 = kernel_paths(EngineConfig(dtype="bfloat16"))
    reason = native_gemm.unavailable_reason()  # on a CPU without the instructions, the library says why
    expected = "projections in the native AVX512-BF16 GEMM" if not reason else f"projections in oneDNN ({reason})"
    assert bf16.startswith("native bf16 (avx512_bf16)") and expected in bf16
    _, _, bf16 = kernel_paths(EngineConfig(dtype="bfloat16", kernels=KernelConfig(native_cpu_kernels=False)))
    assert "projections in oneDNN (disabled by --no-native-kernels" in bf16


def test_a_cache_the_native_kernel_cannot_read_takes_the_reference(monkeypatch, caplog) -> None:
    """--kv-cache-dtype float16 under float32 weights: the native kernel reads it where its library
    has the float16 kernels; where the compiler had no _Float16, auto skips it, saying why. The
    start-up log names the cache dtype either way."""
    from refengine.kernels.attention import registry
    from refengine.kernels.attention.cpu_paged import native_kernel_unavailable_reason

    unavailable = native_kernel_unavailable_reason()
    with caplog.at_level(logging.INFO, logger="refengine.engine.info"):
        backend, _, _ = kernel_paths(EngineConfig(kv_cache_dtype="float16"))
    assert backend == ("torch" if unavailable else "cpu")
    assert any("KV cache in float16 under float32 weights" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(registry, "float16_cache_available", lambda: False)
    backend, why, _ = kernel_paths(EngineConfig(kv_cache_dtype="float16"))
    assert backend == "torch" and (unavailable or "compiler without _Float16") in why


def test_the_bf16_line_names_the_cache_dtype_attention_reads(monkeypatch) -> None:
    """bf16 dot products only over a bf16 cache; over a float16 one the kernel widens the queries
    (found by review: the line named vdpbf16ps over a float16 cache)."""
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    backend, _, bf16 = kernel_paths(EngineConfig(dtype="bfloat16", kv_cache_dtype="float16"))
    if backend == "cpu":
        assert "attention in the native attention kernel on a float16 KV cache (fp32 accumulation; queries " \
               "widened to float32)" in bf16, bf16
    else:
        assert f"attention in the {backend} attention backend on a float16 KV cache" in bf16, bf16
    _, _, bf16 = kernel_paths(EngineConfig(dtype="bfloat16"))
    assert "on a bfloat16 KV cache" in bf16, bf16
    from refengine.kernels.attention.cpu_paged import bf16_query_form

    if backend == "cpu" and bf16_query_form() is not None:
        assert "dot products by" in bf16, bf16
