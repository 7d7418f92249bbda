"""Host memory: the KV cache as one zeroed slab (on transparent huge pages where NIXL reads it),
and step buffers kept for reuse.

Why huge pages, and only for NIXL: NIXL's loopback READ (UCX over CMA, ``process_vm_readv``)
walks the source's and the destination's page tables page by page. Over 4 KiB pages, 60
descriptors of 1.5 MiB (one pull of 2,048 tokens of SmolLM2's KV) read at 7–9 GB/s on the 2-core
AVX512 machine of 2026-12-02; over 2 MiB pages they read at 16.5 GB/s, the rate of one 90 MiB
descriptor (``benchmarks/README.md``, the disagg section). torch's allocator never asks for huge
pages, and with the kernel's usual ``transparent_hugepage=madvise`` it gets none. The price is
paid at start-up: under the usual ``defrag=madvise`` each fault in an advised range compacts
memory until a 2 MiB page is free, and on a host whose free memory is fragmented that took
4–11 s per GiB on the same VM (2026-12-04: a 90 MiB cache 0.75–1.1 s, 1 GiB 4–7 s), against
about 0.35 s per GiB on 4 KiB pages; the CPU attention kernels read the cache no faster from huge
pages (``benchmarks/cpu_attention.py``'s decode rows, within noise). So a slab is advised only when
the engine's NIXL backend registers it (``huge_pages``: the decode role, and the prefill role
offering NIXL, where NIXL can be imported).

A slab is one buffer whose interior is 2 MiB-aligned, advised ``MADV_HUGEPAGE`` (when asked)
*before* its first touch (the zeroing), which is when pages are faulted in. Where the advice
fails (not Linux, THP off) the tensors are the same, only on small pages: nothing depends on it
but speed.

The step buffers: ``keep_freed_memory`` makes glibc's malloc keep what a step frees for the
next step instead of handing it back to the kernel. By default glibc serves a buffer above its
adaptive mmap threshold (at most 32 MiB) with a fresh mapping, and trims the heap's free top
above its trim threshold, so a step faults its large activations in again, page by page. On the
2-core VM of 2026-12-03, a lone 2,048-token float32 SmolLM2 prefill faulted in 100,000-180,000
pages per step (its gate/up output alone is 25 MiB) and took 2.6-2.7 s; with both thresholds at
512 MiB it faults in none and takes 2.4 s. (bfloat16 halves the buffers, which then stay under
the adaptive threshold; the mixed workload of ``benchmarks/cpu_bf16.py`` faulted in only ~11,000
pages per run either way.) The cost: the process keeps its peak step working set, up to the
threshold, after the step, as any caching allocator does. Chunks larger than a thread arena's
64 MiB heap are still mapped afresh when allocated off the main thread. Only glibc on Linux;
elsewhere the call does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import os
import sys
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h (glibc)
KEPT_CHUNK_BYTES = 512 << 20
TENSOR_ALIGNMENT = 4096  # each tensor starts on a page: block 0 of every region is page-aligned


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library on Linux (madvise, and mallopt where it is glibc); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    libc = _libc()
    try:
        if libc is None or not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
    except (ValueError, OSError):  # not glibc (musl has no such name)
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


@functools.cache
def keep_freed_memory() -> bool:
    """Keep freed buffers of up to ``KEPT_CHUNK_BYTES`` in the process heap for reuse (see the
    module docstring). Process-wide and idempotent; True when glibc took both settings."""
    libc = _glibc()
    if libc is None:
        return False
    kept = all(libc.mallopt(option, KEPT_CHUNK_BYTES) == 1 for option in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD))
    logger.debug("malloc keeps freed chunks up to %d MiB: %s", KEPT_CHUNK_BYTES >> 20, kept)
    return kept


def advise_huge_pages(address: int, num_bytes: int) -> bool:
    """Ask for transparent huge pages on ``[address, address + num_bytes)`` (page-aligned
    ``address``); True when the kernel accepted the advice."""
    libc = _libc()
    if libc is None or num_bytes <= 0:
        return False
    if libc.madvise(address, num_bytes, MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
        return False
    return True


def _aligned(num_bytes: int, alignment: int) -> int:
    return -(-num_bytes // alignment) * alignment


def _fresh_bytes(num_bytes: int) -> torch.Tensor:
    """``num_bytes`` of untouched memory: where there is ``mmap`` with flags, a private anonymous
    mapping of its own (private: shared anonymous memory is shmem, which THP's ``enabled`` does
    not cover), never a reused heap chunk (``keep_freed_memory``), so the first touch is the
    first touch. The tensor and its views keep the mapping alive."""
    if not hasattr(mmap, "MAP_PRIVATE"):
        return torch.empty(num_bytes, dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)


def zeroed_slab(shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, huge_pages: bool) -> list[torch.Tensor]:
    """Zeroed contiguous CPU tensors of ``shapes``, views into one slab, each starting on a page
    boundary; the slab on huge pages where ``huge_pages`` and the kernel grants them."""
    element_size = torch.empty((), dtype=dtype).element_size()
    sizes = [math.prod(shape) * element_size for shape in shapes]
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + _aligned(size, TENSOR_ALIGNMENT))
    total = _aligned(offsets[-1], HUGE_PAGE_BYTES)
    slab = _fresh_bytes(total + HUGE_PAGE_BYTES)  # room to align the start
    start = (-slab.data_ptr()) % HUGE_PAGE_BYTES
    slab = slab[start:start + total]
    advised = huge_pages and advise_huge_pages(slab.data_ptr(), total)
    slab.zero_()  # the first touch: pages are faulted in now, huge where advised
    logger.debug("KV slab of %.1f MiB, huge pages %s", total / 2**20,
                 "advised" if advised else "not available" if huge_pages else "not asked for")
    return [slab[offset:offset + size].view(dtype).view(shape)
            for offset, size, shape in zip(offsets[:-1], sizes, shapes, strict=True)]
