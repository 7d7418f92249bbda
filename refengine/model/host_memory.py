"""Host memory for the KV cache: one zeroed slab on transparent huge pages.

Why: NIXL's loopback READ (UCX over CMA, ``process_vm_readv``) walks the source's and the
destination's page tables page by page. Over 4 KiB pages, 60 descriptors of 1.5 MiB (one
pull of 2,048 tokens of SmolLM2's KV) read at 7–9 GB/s on the 2-core AVX512 machine of
2026-12-02; over 2 MiB pages they read at 16.5 GB/s, the rate of one 90 MiB descriptor
(``benchmarks/README.md``, the disagg section). torch's allocator never asks for huge
pages, and with the kernel's usual ``transparent_hugepage=madvise`` it gets none.

So every K and V tensor is a view into one buffer whose interior is 2 MiB-aligned and
advised ``MADV_HUGEPAGE`` *before* its first touch (the zeroing), which is when pages are
faulted in. Where the advice fails (not Linux, THP off) the tensors are the same, only on
small pages: nothing depends on it but speed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import sys
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h
TENSOR_ALIGNMENT = 4096  # each tensor starts on a page: block 0 of every region is page-aligned


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc.madvise


def advise_huge_pages(address: int, num_bytes: int) -> bool:
    """Ask for transparent huge pages on ``[address, address + num_bytes)`` (page-aligned
    ``address``); True when the kernel accepted the advice."""
    madvise = _madvise()
    if madvise is None or num_bytes <= 0:
        return False
    if madvise(address, num_bytes, MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
        return False
    return True


def _aligned(num_bytes: int, alignment: int) -> int:
    return -(-num_bytes // alignment) * alignment


def zeros_on_huge_pages(shapes: Sequence[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zeroed contiguous CPU tensors of ``shapes``, views into one slab on huge pages (where
    the kernel grants them), each starting on a page boundary."""
    element_size = torch.empty((), dtype=dtype).element_size()
    sizes = [math.prod(shape) * element_size for shape in shapes]
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + _aligned(size, TENSOR_ALIGNMENT))
    total = _aligned(offsets[-1], HUGE_PAGE_BYTES)
    slab = torch.empty(total + HUGE_PAGE_BYTES, dtype=torch.uint8)  # room to align the start
    start = (-slab.data_ptr()) % HUGE_PAGE_BYTES
    slab = slab[start:start + total]
    advised = advise_huge_pages(slab.data_ptr(), total)
    slab.zero_()  # the first touch: pages are faulted in now, huge where advised
    logger.debug("KV slab of %.1f MiB, huge pages %s", total / 2**20, "advised" if advised else "not available")
    return [slab[offset:offset + size].view(dtype).view(shape)
            for offset, size, shape in zip(offsets[:-1], sizes, shapes, strict=True)]
