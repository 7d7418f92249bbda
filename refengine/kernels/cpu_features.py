"""What this CPU computes natively, read once at run time (never assumed: machines differ).

``native_bf16()``: the CPU has bf16 dot products (AVX512-BF16 or AMX-BF16), so oneDNN's
bf16 GEMMs run at about twice the fp32 rate (7x with AMX at large batches) and a bf16 KV
cache halves the bytes a decode step reads. Without them bf16 is emulated and slower than
fp32: ``bf16_path`` says so, and the engine warns at start-up.

The bf16 path is batch-invariant (RULES G18), as float32 is: the native bf16 GEMM sums each
output in one fixed order (``kernels/native_gemm.py``); oneDNN's bf16 GEMM (with AMX, or
``--no-native-kernels``) takes another kernel (another K-reduction rounding) for other row
counts, so ``Linear`` runs every oneDNN bf16 call as calls of one fixed row count (``kernels/linear.py``).
"""

from __future__ import annotations

import functools
from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The ``flags`` of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def native_bf16() -> bool:
    return any(flag in cpu_flags() for flag in BF16_FLAGS)


def bf16_path(gemm: str, attention: str) -> str:
    """One line for start-up logs and ServerInfo: which bf16 path runs on this CPU, and why.
    ``gemm`` names what runs the bf16 projections (``kernels.linear.bf16_gemm``), ``attention``
    what runs bf16 attention (``engine.info``)."""
    found = [flag for flag in BF16_FLAGS if flag in cpu_flags()]
    if found:
        return f"native bf16 ({', '.join(found)}): bf16 projections in {gemm}, attention in {attention}"
    return "no native bf16 on this CPU (no avx512_bf16 or amx_bf16): bf16 is emulated and slower than float32"
