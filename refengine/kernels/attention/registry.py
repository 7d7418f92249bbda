"""Which attention backends exist, and which one a run gets.

Each backend registers a factory and an availability check (``""``, or why it cannot
run for this compute dtype, KV cache dtype, device and ``KernelConfig``). ``auto`` takes the first registered
backend that is available, so registration order is preference order: the fastest,
narrowest backend first, the torch reference (any dtype, any device) last. Naming a
backend insists on it: unavailable is an error carrying the reason.

``refengine.config.ATTENTION_BACKENDS`` repeats ``auto`` and the registered names, in order, for
code that may not import torch; ``tests/unit/test_config.py`` checks that they agree.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from refengine.config import KernelConfig
from refengine.kernels.attention.base import AttentionBackend
from refengine.kernels.attention.cpu_paged import (
    CpuPagedBackend,
    float16_cache_available,
    native_kernel_unavailable_reason,
)
from refengine.kernels.attention.torch_ref import TorchReferenceBackend
from refengine.kernels.cpu_features import native_bf16

logger = logging.getLogger(__name__)

AUTO = "auto"
# The factory and the check both take (dtype, kv_dtype, device, kernels); the factory runs only when
# the check returned "".
BackendFactory = Callable[[torch.dtype, torch.dtype, str, KernelConfig], AttentionBackend]
UnavailableReason = Callable[[torch.dtype, torch.dtype, str, KernelConfig], str]


@dataclass(frozen=True)
class _Entry:
    factory: BackendFactory
    unavailable_reason: UnavailableReason


_BACKENDS: dict[str, _Entry] = {}  # insertion order = auto's preference order


def register_backend(name: str, factory: BackendFactory, unavailable_reason: UnavailableReason) -> None:
    """Add a backend after those already registered (so ``auto`` prefers it least)."""
    if name == AUTO or name in _BACKENDS:
        raise ValueError(f"attention backend name {name!r} is reserved or already registered")
    _BACKENDS[name] = _Entry(factory, unavailable_reason)


def unavailable_reason(name: str, dtype: torch.dtype, device: str, kernels: KernelConfig,
                       kv_dtype: torch.dtype | None = None) -> str:
    """Why backend ``name`` cannot run here; "" when it can. ``kv_dtype`` None = ``dtype``."""
    return _entry(name).unavailable_reason(dtype, kv_dtype or dtype, device, kernels)


def available_backends(dtype: torch.dtype, device: str, kernels: KernelConfig,
                       kv_dtype: torch.dtype | None = None) -> tuple[str, ...]:
    """The registered backends that can run for these dtypes, device and kernel switches."""
    return tuple(name for name, entry in _BACKENDS.items()
                 if not entry.unavailable_reason(dtype, kv_dtype or dtype, device, kernels))


def choose_backend(name: str, dtype: torch.dtype, device: str, kernels: KernelConfig,
                   kv_dtype: torch.dtype | None = None) -> tuple[str, str]:
    """(the backend ``name`` resolves to, why): ``auto`` takes the first available one and says
    why the ones before it were skipped. Raises ValueError for an unknown or unavailable name."""
    if name != AUTO:
        reason = unavailable_reason(name, dtype, device, kernels, kv_dtype)
        if reason:
            raise ValueError(f"attention backend {name!r} is unavailable: {reason}")
        return name, "named by --attention-backend"
    skipped = []
    for candidate, entry in _BACKENDS.items():
        reason = entry.unavailable_reason(dtype, kv_dtype or dtype, device, kernels)
        if not reason:
            return candidate, "auto: the first available" + (f" ({'; '.join(skipped)})" if skipped else "")
        skipped.append(f"{candidate}: {reason}")
    raise ValueError(f"no attention backend is available: {'; '.join(skipped)}")


def make_attention_backend(
    name: str, dtype: torch.dtype, device: str, kernels: KernelConfig | None = None,
    kv_dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """The backend ``name`` resolves to (``choose_backend``) for ``dtype`` queries on a
    ``kv_dtype`` cache (None = ``dtype``). Raises ValueError for an unknown or unavailable name."""
    kernels = kernels if kernels is not None else KernelConfig()
    chosen, why = choose_backend(name, dtype, device, kernels, kv_dtype)
    logger.info("attention backend %s (%s)", chosen, why)  # named too: the start-up log says what runs
    return _BACKENDS[chosen].factory(dtype, kv_dtype or dtype, device, kernels)


def _entry(name: str) -> _Entry:
    if name not in _BACKENDS:
        choices = ", ".join((AUTO, *_BACKENDS))
        raise ValueError(f"unknown attention backend {name!r}; choose one of {choices}")
    return _BACKENDS[name]


# ----------------------------------------------------------------------------- built-in backends


def _flashinfer_unavailable(dtype: torch.dtype, kv_dtype: torch.dtype, device: str, kernels: KernelConfig) -> str:
    # the module imports without FlashInfer; its check only asks importlib.util.find_spec
    from refengine.kernels.attention.flashinfer_backend import flashinfer_unavailable_reason

    if reason := flashinfer_unavailable_reason(dtype, device):
        return reason
    if kv_dtype != dtype:  # its paged fp16/bf16 kernels read the cache in the query dtype
        return f"it needs the KV cache in the query dtype {dtype}, not {kv_dtype}"
    return ""


def _make_flashinfer(dtype: torch.dtype, kv_dtype: torch.dtype, device: str, kernels: KernelConfig) -> AttentionBackend:
    from refengine.kernels.attention.flashinfer_backend import FlashInferBackend

    return FlashInferBackend(device)


def _triton_unavailable(dtype: torch.dtype, kv_dtype: torch.dtype, device: str, kernels: KernelConfig) -> str:
    if torch.device(device).type != "cuda":  # checked before importing Triton: CPU runs never import it
        return f"it needs CUDA, not {device} (Triton kernels run on the CPU only under TRITON_INTERPRET=1, for tests)"
    from refengine.kernels.attention.triton_paged import unavailable_reason as triton_unavailable_reason

    return triton_unavailable_reason(dtype, device) or triton_unavailable_reason(kv_dtype, device)


def _make_triton(dtype: torch.dtype, kv_dtype: torch.dtype, device: str, kernels: KernelConfig) -> AttentionBackend:
    from refengine.kernels.attention.triton_paged import TritonPagedBackend

    return TritonPagedBackend()


def _cpu_unavailable(dtype: torch.dtype, kv_dtype: torch.dtype, device: str, kernels: KernelConfig) -> str:
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return f"it needs float32 (or bfloat16 with native bf16) on CPU, not {dtype} on {device}"
    if dtype == torch.bfloat16 and not native_bf16():
        return "bfloat16 needs a CPU with native bf16 dot products (avx512_bf16 or amx_bf16)"
    # Any CPU: bf16 widens by a shift, float16 by an exact conversion where the compiler has _Float16.
    if kv_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"its kernel reads a float32, bfloat16 or float16 KV cache, not {kv_dtype}"
    if reason := native_kernel_unavailable_reason(kernels.native_cpu_kernels):
        return reason
    if kv_dtype == torch.float16 and not float16_cache_available():
        return "its library was built by a compiler without _Float16: no float16 KV cache kernels"
    return ""


def _always_available(dtype: torch.dtype, kv_dtype: torch.dtype, device: str, kernels: KernelConfig) -> str:
    return ""


# CUDA only, fastest first: FlashInfer where it is installed (fp16/bf16), else the Triton kernels.
register_backend("flashinfer", _make_flashinfer, _flashinfer_unavailable)
register_backend("triton", _make_triton, _triton_unavailable)
register_backend("cpu", lambda dtype, kv_dtype, device, kernels: CpuPagedBackend(dtype, kv_dtype), _cpu_unavailable)
register_backend("torch", lambda dtype, kv_dtype, device, kernels: TorchReferenceBackend(), _always_available)
