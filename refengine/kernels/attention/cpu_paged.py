"""The CPU attention backend: native kernels that read the paged cache in place.

Where it takes the shape (head_dim a multiple of 16 up to 256, block_size a power of two from
16 to 256: every model refengine ships), every row of a step -- decode rows and prefill chunks,
fresh or continuing a cached context -- goes through one kernel, ``chunk_attention``
(``kernels/cpu/paged_attention_chunk.h``): a tile of query vectors per key load, with an online
softmax over key tiles at fixed absolute positions. One kernel and one arithmetic per row means
a row's result depends only on its query, position and keys: not on the batch, nor on how its
prompt was chunked, nor on whether it was a prompt row or a decode row. On SmolLM2's shapes it
ran prefill attention 1.6-2.8x (float32) and 2.0-3.4x (bfloat16) as fast as SDPA's CPU flash
kernel on AVX512-BF16 machines without AMX, and decode attention at 1.05-1.48x (float32 cache)
and 1.17-1.66x (bfloat16 cache) the speed of the row kernel it replaced for decode rows
(``benchmarks/cpu_attention.py``). With AMX, a bfloat16 model on a bfloat16 cache takes the chunk
kernel's AMX form (``chunk_attention_bf16amx``, ``kernels/cpu/paged_attention_amx.h``) for every
row where head_dim is a multiple of 32: 1.3-2.6x the vector form's speed on prompts, about the
same on decode rows, with its own cache layout (keys row-major, values transposed: the vector
forms' swapped), which ``kv_cache_shapes`` gives a backend made for those dtypes.

Other shapes (a block size under 16, a head_dim not a multiple of 16) take the row kernel
(``paged_attention`` in ``kernels/cpu/paged_attention.c``) for every row: one query vector at a
time over the paged cache, so the same holds. Long chunks of such shapes once went to SDPA's
flash kernel instead, whose result depended on the chunk's length: a prompt prefilled in other
chunks gave logits 1 ulp apart (found by review; G18 promises bit-identical greedy output), so
they no longer do, at the row kernel's speed.

Keys are stored transposed within each block (values so in the AMX form's layout). float32 or
bfloat16 queries (bfloat16 on CPUs with native bf16, ``cpu_features``) on a float32, bfloat16 or
float16 cache (``--kv-cache-dtype``, any pairing): the kernels read 16-bit keys and values and
accumulate in float32 (a float16 cache, where the compiler has ``_Float16``, on any CPU: widening
is exact; on SmolLM2's decode shapes it reads as fast as a bfloat16 one, benchmarks/README.md).
float32 queries are read as they are; bfloat16 queries on a bfloat16 cache that the AMX form
does not take go, where the library was built with AVX-512, to ``chunk_attention_bf16q`` or
``chunk_attention_bf16qf``, which read their bits and score them as ``vdpbf16ps`` does (exact
products of two bfloat16, float32 sums), and sum the values that way too, by pairs of positions
under the softmax weights rounded to bfloat16 (as GPU flash attention rounds P; the softmax sum
adds the rounded weights: ``paged_attention_values.h``).
The first uses ``vdpbf16ps`` (AVX512-BF16), the second float32 multiply-adds in its order, with the
same bits; ``bf16_query_form`` takes the faster on this core, measured once. Elsewhere bf16
queries are widened to float32 per step. The step's keys and values are rounded to the cache
dtype first, so that a prompt's result does not depend on how it was chunked. The backend
registry (``registry.py``) picks the torch reference for other dtypes and devices.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from refengine.kernels import cpu
from refengine.kernels.attention.base import AttentionBackend, AttentionMetadata


def native_kernel_unavailable_reason(enabled: bool = True) -> str:
    """Why the native kernel cannot be used here; "" when it can. ``enabled`` is
    ``KernelConfig.native_cpu_kernels``."""
    return cpu.load("paged_attention", enabled).reason


#: The query dtypes the kernels take (bfloat16 only where the CPU has native bf16: registry.py).
QUERY_DTYPES = (torch.float32, torch.bfloat16)


def float16_cache_available() -> bool:
    """Whether the library has the float16-cache kernels: built where the compiler has a
    ``_Float16`` (kernels/cpu/paged_attention.c). Only asked once the library has loaded."""
    library = cpu.load("paged_attention").library
    return library is not None and bool(library.paged_attention_f16_available())


# The chunk kernel's entry points for bfloat16 queries on a bfloat16 cache, by the dot products
# they compute with. Both give the same bits (kernels/cpu/paged_attention_scores.h).
BF16_QUERY_KERNELS = {"vdpbf16ps": "chunk_attention_bf16q", "float32 multiply-adds": "chunk_attention_bf16qf"}
# vdpbf16ps is kept unless it computes products clearly slower than float32 multiply-adds
# (bf16_dot_product_speed): on this project's AMX Xeon it measured 0.5, on Zen 4 near 2.
VDPBF16PS_KEPT_FROM_SPEED = 0.8


def bf16_query_kernels(library: ctypes.CDLL) -> dict[str, Callable[..., int]]:
    """The bf16-query entry points ``library`` was built with (BF16_QUERY_KERNELS' names), typed."""
    kernels = {}
    for name, symbol in BF16_QUERY_KERNELS.items():
        available = getattr(library, f"{symbol}_available")
        available.restype = ctypes.c_int
        if available():
            kernel = getattr(library, symbol)
            kernel.restype = ctypes.c_int
            kernel.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int64]
            kernels[name] = kernel
    return kernels


@dataclass(frozen=True)
class Bf16QueryForm:
    name: str  # a key of BF16_QUERY_KERNELS
    why: str


def choose_bf16_query_form(built: Collection[str], speed: float) -> Bf16QueryForm | None:
    """The form to run among those ``built`` (names of BF16_QUERY_KERNELS), given the measured
    ``speed`` of vdpbf16ps (bf16_dot_product_speed; only read when both are built)."""
    if len(built) < 2:
        return Bf16QueryForm(next(iter(built)), "the only form this library was built with") if built else None
    name = "vdpbf16ps" if speed >= VDPBF16PS_KEPT_FROM_SPEED else "float32 multiply-adds"
    return Bf16QueryForm(name, f"vdpbf16ps computes products at {speed:.2f}x the rate of float32 multiply-adds "
                               f"on this core (the same bits either way; below {VDPBF16PS_KEPT_FROM_SPEED}, "
                               "multiply-adds)")


_probe_lock = threading.Lock()


@functools.cache
def _measured_bf16_query_form() -> Bf16QueryForm | None:
    library = cpu.load("paged_attention").library
    built = bf16_query_kernels(library) if library is not None else {}
    speed = 0.0
    if len(built) == 2:
        library.bf16_dot_product_speed.restype = ctypes.c_double
        speed = library.bf16_dot_product_speed()
    return choose_bf16_query_form(built, speed)


def bf16_query_form() -> Bf16QueryForm | None:
    """How bf16 queries on a bf16 cache are computed here, and why; None where the library has
    neither form (they are then widened to float32 per step). Measured once per process, under a
    lock: two engines built at once must not measure twice and perhaps choose differently."""
    with _probe_lock:
        return _measured_bf16_query_form()


@functools.cache
def _amx_kernel() -> Callable[..., int] | None:
    library = cpu.load("paged_attention").library
    if library is None or not library.chunk_attention_bf16amx_available():
        return None
    kernel = library.chunk_attention_bf16amx
    kernel.restype = ctypes.c_int
    kernel.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int64]
    return kernel


def amx_form_available() -> bool:
    """Whether bf16 attention can run on AMX tiles here (``chunk_attention_bf16amx``): the library
    was built with AMX-BF16 and Linux granted this process the AMX state."""
    with _probe_lock:
        return _amx_kernel() is not None


class CpuPagedBackend(AttentionBackend):
    """``dtype`` and ``kv_dtype`` (None = ``dtype``): the queries and the cache it will be given.
    Both bfloat16 on a CPU with AMX: the AMX form (``kernels/cpu/paged_attention_amx.h``) takes
    the shapes it can (head_dim a multiple of 32), with its own cache layout, which
    ``kv_cache_shapes`` gives: keys row-major and values transposed, the vector forms' swapped."""

    def __init__(self, dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None) -> None:
        library = cpu.load("paged_attention").library
        if library is None:
            raise RuntimeError(f"native CPU attention unavailable: {native_kernel_unavailable_reason()}")
        # The kernels by cache dtype (queries float32 or bfloat16 whatever the cache holds).
        suffixes = {torch.float32: "", torch.bfloat16: "_bf16"}
        if float16_cache_available():
            suffixes[torch.float16] = "_f16"
        self._row_kernels = {dtype: getattr(library, f"paged_attention{s}") for dtype, s in suffixes.items()}
        self._chunk_kernels = {dtype: getattr(library, f"chunk_attention{s}") for dtype, s in suffixes.items()}
        self._stores = {dtype: getattr(library, f"store_kv{s}") for dtype, s in suffixes.items()}
        for kernel in (*self._row_kernels.values(), *self._chunk_kernels.values()):
            kernel.restype = ctypes.c_int
            kernel.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int64]
        for store in self._stores.values():
            store.restype = None
            store.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4 + [ctypes.c_int64] * 2
        # bf16 queries on a bf16 cache: the faster of the two forms built (they give the same bits).
        form = bf16_query_form()
        self._bf16_query_kernel = bf16_query_kernels(library).get(form.name) if form else None
        chunk_attention_supported = library.chunk_attention_supported
        chunk_attention_supported.restype = ctypes.c_int
        chunk_attention_supported.argtypes = [ctypes.c_int, ctypes.c_int]
        # (head_dim, block_size) -> whether the chunk kernel takes it: asked once per shape, not per layer.
        self._chunk_kernel_takes = functools.cache(lambda head_dim, block_size: bool(
            chunk_attention_supported(head_dim, block_size)))
        amx = dtype == (kv_dtype or dtype) == torch.bfloat16 and amx_form_available()
        self._amx_kernel = _amx_kernel() if amx else None
        amx_supported = library.chunk_attention_bf16amx_supported
        amx_supported.restype = ctypes.c_int
        amx_supported.argtypes = [ctypes.c_int, ctypes.c_int]
        # (head_dim, block_size) -> whether the AMX form runs it (and the cache has its layout).
        self._amx_takes = functools.cache(lambda head_dim, block_size: self._amx_kernel is not None and bool(
            amx_supported(head_dim, block_size)))
        self._meta: AttentionMetadata | None = None

    def kv_cache_shapes(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Keys transposed within a block (``[num_kv_heads, head_dim, block_size]``), so the
        kernel scores a whole block as one vector; values row-major. See the C source. The AMX
        form's layout is the other way round (``paged_attention_amx.h``)."""
        transposed, row_major = (num_blocks, num_kv_heads, head_dim, block_size), (num_blocks, block_size,
                                                                                   num_kv_heads, head_dim)
        return (row_major, transposed) if self._amx_takes(head_dim, block_size) else (transposed, row_major)

    def kv_layout_name(self, head_dim: int, block_size: int) -> str:
        """The AMX layout's shapes equal the vector forms' where num_kv_heads == head_dim ==
        block_size: the name tells them apart (an engine on one must not read the other's blocks)."""
        return f"{type(self).__name__}/amx" if self._amx_takes(head_dim, block_size) else type(self).__name__

    def prepare(self, meta: AttentionMetadata) -> None:
        self._meta = meta
        # int32 copies the kernels read; kept alive on self until the next prepare().
        self._all_seq_ids = torch.arange(meta.num_seqs, dtype=torch.int32)
        self._query_start_loc = torch.tensor(meta.query_start_loc, dtype=torch.int32)
        self._seq_lens = torch.tensor(meta.seq_lens, dtype=torch.int32)
        self._block_tables = meta.block_tables.to(torch.int32).contiguous()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        meta = self._meta
        assert meta is not None, "prepare() must run before forward()"
        kv_dtype = k_cache.dtype
        assert kv_dtype in self._row_kernels and q.dtype in QUERY_DTYPES and q.is_cpu, \
            "the native kernel takes float32 or bfloat16 queries on CPU, on a float32, bfloat16 or float16 cache"
        # The cache's layout follows from the queries' head_dim, as kv_cache_shapes chose it.
        _, num_heads, q_head_dim = q.shape
        amx = self._amx_takes(q_head_dim, meta.block_size)
        num_kv_heads, head_dim = (k_cache if amx else v_cache).shape[2:]  # the row-major one
        # The kernels take these from the cache and trust q to fit: a head count not a multiple of the
        # KV heads left rows unwritten (chunk kernel) or read past the cache's KV heads (row kernel).
        if num_heads % num_kv_heads or q_head_dim != head_dim:
            raise ValueError(f"paged attention: {num_heads} query heads of size {q_head_dim} do not fit a cache of "
                             f"{num_kv_heads} KV heads of size {head_dim} (query heads must be a multiple of KV heads)")
        # Rounded to what the cache holds; skipped when equal, as a .to() that changes nothing still
        # costs its dispatch (~3 us each, per layer of a decode step).
        if k.dtype != kv_dtype or v.dtype != kv_dtype:
            k, v = k.to(kv_dtype), v.to(kv_dtype)
        # Rows may be strided (views into the fused QKV output); each row must be contiguous.
        q, k, v = (t if t.stride(2) == 1 and t.stride(1) == head_dim else t.contiguous() for t in (q, k, v))
        if amx:
            if not q.dtype == kv_dtype == torch.bfloat16:  # the AMX kernel would read float32 as bf16
                raise TypeError(f"paged attention: this backend's cache layout is the AMX form's, for bf16 queries "
                                f"on a bf16 cache, not {q.dtype} on {kv_dtype}")
            # The store writes its first cache transposed and its second row-major: the AMX layout
            # is the same store with keys and values swapped.
            self._stores[kv_dtype](v_cache.data_ptr(), k_cache.data_ptr(), v.data_ptr(), k.data_ptr(),
                                   meta.slot_mapping.data_ptr(), k.shape[0], num_kv_heads, head_dim,
                                   meta.block_size, v.stride(0), k.stride(0))
        else:
            self._stores[kv_dtype](k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(),
                                   meta.slot_mapping.data_ptr(), k.shape[0], num_kv_heads, head_dim,
                                   meta.block_size, k.stride(0), v.stride(0))
        # The kernels' queries and outputs are float32 whatever the cache holds: a bf16 step
        # collects every row in float32 and rounds once at the end.
        out = torch.empty(q.shape, dtype=torch.float32)
        kernel_q = q
        if amx:
            kernel = self._amx_kernel
        elif self._chunk_kernel_takes(head_dim, meta.block_size):
            kernel = self._chunk_kernels[kv_dtype]
            if q.dtype == kv_dtype == torch.bfloat16 and self._bf16_query_kernel is not None:
                kernel = self._bf16_query_kernel  # reads the bf16 queries as they are: no float32 copy
        else:
            kernel = self._row_kernels[kv_dtype]
        if meta.num_seqs:
            if kernel not in (self._bf16_query_kernel, self._amx_kernel) and q.dtype != torch.float32:
                kernel_q = q.float()
            status = kernel(out.data_ptr(), kernel_q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                            self._block_tables.data_ptr(), self._query_start_loc.data_ptr(),
                            self._seq_lens.data_ptr(), self._all_seq_ids.data_ptr(), meta.num_seqs, num_heads,
                            num_kv_heads, head_dim, meta.block_size, self._block_tables.shape[1], scale,
                            kernel_q.stride(0))
            if status != 0:
                raise MemoryError("paged attention: could not allocate scratch memory")
        return out if q.dtype == torch.float32 else out.to(q.dtype)
