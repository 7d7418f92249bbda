"""Multi-LoRA deltas on the CPU in one native call per projection (``cpu/lora_ops.c``).

The torch path (``lora.apply_lora_parts``) runs a shrink and an expand matmul per module and
adapter segment; on a decode step (a few rows per adapter, rank 16) each costs its dispatch
more than its arithmetic. The C kernel walks the step's adapter tokens once, in parallel,
each token's shrink and expands in fixed order, so results do not depend on the batch.
float32 CPU tensors with row-contiguous ``x`` and ``y`` and the slot buffers in their
``LoraLinear`` storage; anything else, a rank above ``MAX_WIDTH``, or no compiler → the caller
keeps the torch path (``native_lora_available``).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from refengine.kernels import cpu
from refengine.kernels.lora import LoraBatch

MAX_PARTS, MAX_WIDTH = 3, 3 * 128  # the C kernel's stack buffer: num_parts * rank values


@functools.cache
def _kernel(enabled: bool) -> ctypes._CFuncPtr | None:
    library = cpu.load("lora_ops", enabled).library
    if library is None:
        return None
    kernel = library.lora_delta
    kernel.restype = None
    kernel.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 7
                       + [ctypes.c_int] * 3 + [ctypes.c_int64] * 2)
    return kernel


def native_lora_available(enabled: bool = True) -> bool:
    """``enabled``: ``KernelConfig.native_cpu_kernels``."""
    return _kernel(enabled) is not None


def fits(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b_parts: tuple[torch.Tensor, ...]) -> bool:
    """Whether the kernel takes these tensors (see the module docstring)."""
    tensors = (y, x, lora_a, *lora_b_parts)
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and len(lora_b_parts) <= MAX_PARTS
            and lora_a.shape[1] <= MAX_WIDTH and x.stride(1) == 1 and y.stride(1) == 1
            and lora_a.transpose(1, 2).is_contiguous() and all(b.transpose(1, 2).is_contiguous() for b in lora_b_parts))


def apply_lora_native(y: torch.Tensor, x: torch.Tensor, batch: LoraBatch, lora_a: torch.Tensor,
                      lora_b_parts: tuple[torch.Tensor, ...], active: torch.Tensor, enabled: bool = True) -> None:
    """``y += delta`` in place, as ``apply_lora_parts`` (``active``: uint8 per slot, 1 = the
    slot's adapter targets this projection). Call only when ``fits`` and the kernel loaded."""
    kernel = _kernel(enabled)
    assert kernel is not None and fits(y, x, lora_a, lora_b_parts)
    rank = lora_b_parts[0].shape[2]
    sizes = torch.tensor([b.shape[1] for b in lora_b_parts], dtype=torch.int64)
    offsets = torch.cumsum(sizes, 0) - sizes
    pointers = [b.data_ptr() for b in lora_b_parts] + [0] * (MAX_PARTS - len(lora_b_parts))
    kernel(y.data_ptr(), x.data_ptr(), batch.token_indices.data_ptr(), batch.token_slots.data_ptr(),
           batch.num_tokens, active.data_ptr(), lora_a.data_ptr(), *pointers, sizes.data_ptr(), offsets.data_ptr(),
           len(lora_b_parts), x.shape[1], rank, x.stride(0), y.stride(0))
