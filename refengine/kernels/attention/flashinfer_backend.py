"""The FlashInfer attention backend (CUDA, fp16/bf16): paged attention through
FlashInfer's batch wrappers over the default cache layout.

NOT YET VERIFIED ON A GPU IN THIS REPO. Written against the FlashInfer 0.6.18 Python API
(``flashinfer-python``, the ``gpu`` extra); on CPU the tests check the index building
(``paged_kv_plan``) against hand-computed values and the call sequence against a fake
``flashinfer`` module that evaluates the planned indices as FlashInfer documents them.
``tests/unit/test_flashinfer_backend.py`` holds the CUDA comparison with the torch
reference (marked ``gpu``), which has not been run yet.

Layout. FlashInfer's paged ``NHD`` layout, as a ``(k_cache, v_cache)`` pair per layer:
each ``[num_blocks, block_size, num_kv_heads, head_dim]`` (FlashInfer's "page" = our
block, so dimension 0 stays the block and whole-block copies need no layout knowledge).
That is the interface's default layout, so caches written by another backend read the same.

Per step.

* ``prepare`` (once, before any layer) calls ``paged_kv_plan``, a pure function of the
  ``AttentionMetadata``, for FlashInfer's CSR page table: ``qo_indptr`` (=
  ``query_start_loc``), ``paged_kv_indptr`` (running sum of each sequence's page count
  ``ceil(seq_len / block_size)``), ``paged_kv_indices`` (each sequence's first pages from
  its block-table row, concatenated) and ``paged_kv_last_page_len`` (``seq_len - (pages -
  1) * block_size``, in ``1 … block_size``), all int32 as FlashInfer requires. The
  indptrs and last-page lengths stay on the CPU (FlashInfer's planner reads them on the
  host and uploads them itself: no device sync); the page indices are gathered on the
  block tables' device.
* The wrapper's ``plan`` runs once per step, on the first layer's ``forward``: it needs
  the query/KV head counts, head dim, dtype and softmax scale, which arrive with the
  tensors, not with the metadata. Every later layer with the same signature (all of them
  in this repo's models) reuses it and only calls ``run``; a different signature re-plans.
  A step whose queries are all one token plans the ``BatchDecodeWithPagedKVCacheWrapper``
  (tensor-core decode when a GQA group exceeds ``CUDA_CORE_DECODE_MAX_GROUP``); any other
  step (fresh prefills, chunks continuing a cached context, mixed with decode rows) plans
  the ``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True``, whose mask is
  bottom-right aligned: query row ``r`` of a sequence with ``qo_len`` new and ``kv_len``
  total tokens sees positions ``<= kv_len - qo_len + r``, the interface's rule. GQA: FlashInfer
  maps query head ``h`` to KV head ``h // (num_qo_heads // num_kv_heads)``, as the
  reference does.
* ``forward`` writes the step's keys and values at ``slot_mapping`` (``index_copy_`` into
  the cache viewed as ``[num_blocks * block_size, num_kv_heads, head_dim]``, as the torch
  reference does), then calls ``run(q, (k_cache, v_cache))``.

The workspace (``WORKSPACE_BYTES`` of zeros, as the decode wrapper asks) and the wrappers
are made once, in the constructor; the prefill and decode wrappers share the workspace
(one of them runs in a step).

Invariants relied on: slots are distinct and non-negative (padding slots are not
supported, as in the torch reference); every position below ``seq_len`` is written by this
step or an earlier one, so each sequence's pages are its first ``ceil(seq_len /
block_size)`` block-table entries; ``seq_len >= 1`` and ``0 <= query_len <= seq_len``; the
write and ``run`` are issued on one stream, so ``run`` sees the new keys.

CUDA graphs: ``supports_cuda_graphs`` is False. FlashInfer can be captured (wrappers made
with ``use_cuda_graph=True`` over fixed index buffers, ``plan`` outside the graph), but
the runner hooks for that are not implemented here.

Importing this module never imports FlashInfer: the constructor does, and
``flashinfer_unavailable_reason`` only asks ``importlib.util.find_spec``.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from refengine.kernels.attention.base import AttentionBackend, AttentionMetadata

DTYPES = (torch.float16, torch.bfloat16)
KV_LAYOUT = "NHD"
WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace (split-KV partials)
CUDA_CORE_DECODE_MAX_GROUP = 4  # wider GQA groups decode on the tensor cores (the prefill kernels)
NOT_INSTALLED = "flashinfer is not installed (pip install 'refengine[gpu]')"


def flashinfer_installed() -> bool:
    """True when the ``flashinfer`` package can be found (it is not imported)."""
    return importlib.util.find_spec("flashinfer") is not None


def flashinfer_unavailable_reason(dtype: torch.dtype, device: str) -> str:
    """Why this backend cannot run for ``dtype`` on ``device``; "" when it can."""
    if torch.device(device).type != "cuda":
        return f"it needs CUDA, not {device}"
    if not flashinfer_installed():
        return NOT_INSTALLED
    if not torch.cuda.is_available():
        return "it needs CUDA, and CUDA is not available on this machine"
    if dtype not in DTYPES:
        return f"it needs float16 or bfloat16, not {dtype}"
    return ""


@dataclass(frozen=True)
class PagedKvPlan:
    """One step in FlashInfer's page-table terms (see the module docstring). int32 index
    tensors: the indptrs and last-page lengths on the CPU, the page indices on the block
    tables' device; ``slot_mapping`` as given."""

    qo_indptr: torch.Tensor  # [num_seqs + 1]
    paged_kv_indptr: torch.Tensor  # [num_seqs + 1]
    paged_kv_indices: torch.Tensor  # [paged_kv_indptr[-1]]
    paged_kv_last_page_len: torch.Tensor  # [num_seqs], each in 1 … page_size
    slot_mapping: torch.Tensor  # [num_tokens] int64
    page_size: int
    num_tokens: int
    decode_only: bool  # every sequence has exactly one query token (and there is one)

    @property
    def num_seqs(self) -> int:
        return self.paged_kv_last_page_len.numel()


def paged_kv_plan(meta: AttentionMetadata) -> PagedKvPlan:
    """FlashInfer's ``qo_indptr`` / ``paged_kv_indptr`` / ``paged_kv_indices`` /
    ``paged_kv_last_page_len`` for ``meta``. Pure (no FlashInfer, any device); raises
    ValueError for metadata that breaks the interface's invariants."""
    page_size, num_seqs = meta.block_size, meta.num_seqs
    starts = list(meta.query_start_loc)
    if page_size < 1 or len(starts) != num_seqs + 1 or (starts and starts[0] != 0):
        raise ValueError(f"bad step layout: block_size {page_size}, query_start_loc {starts}, {num_seqs} seqs")
    max_blocks = meta.block_tables.shape[1] if meta.block_tables.dim() == 2 else 0
    page_counts, last_page_lens, flat = [], [], []
    for i, seq_len in enumerate(meta.seq_lens):
        query_len = starts[i + 1] - starts[i]
        if seq_len < 1 or not 0 <= query_len <= seq_len:
            raise ValueError(f"sequence {i}: query length {query_len} with {seq_len} tokens of context")
        pages = -(-seq_len // page_size)
        if pages > max_blocks:
            raise ValueError(f"sequence {i}: {seq_len} tokens need {pages} blocks, the table has {max_blocks}")
        page_counts.append(pages)
        last_page_lens.append(seq_len - (pages - 1) * page_size)
        flat.extend(range(i * max_blocks, i * max_blocks + pages))
    num_tokens = starts[-1] if starts else 0
    if meta.slot_mapping.numel() != num_tokens:
        raise ValueError(f"{meta.slot_mapping.numel()} slots for {num_tokens} query tokens")
    indptr = [0]
    for pages in page_counts:
        indptr.append(indptr[-1] + pages)
    device = meta.block_tables.device
    flat_index = torch.tensor(flat, dtype=torch.int64).to(device)
    indices = meta.block_tables.reshape(-1).index_select(0, flat_index).to(torch.int32)
    return PagedKvPlan(
        qo_indptr=torch.tensor(starts, dtype=torch.int32),
        paged_kv_indptr=torch.tensor(indptr, dtype=torch.int32),
        paged_kv_indices=indices,
        paged_kv_last_page_len=torch.tensor(last_page_lens, dtype=torch.int32),
        slot_mapping=meta.slot_mapping,
        page_size=page_size,
        num_tokens=num_tokens,
        decode_only=num_seqs > 0 and all(starts[i + 1] - starts[i] == 1 for i in range(num_seqs)),
    )


@dataclass(frozen=True)
class _Signature:
    """What a wrapper's ``plan`` depends on besides the page table."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    scale: float


class FlashInferBackend(AttentionBackend):
    """Paged attention through FlashInfer (see the module docstring). ``device``: where
    the workspace lives (the model's CUDA device)."""

    def __init__(self, device: str = "cuda", workspace_bytes: int = WORKSPACE_BYTES) -> None:
        try:
            flashinfer = importlib.import_module("flashinfer")
        except ImportError as error:
            raise RuntimeError(f"FlashInferBackend: {NOT_INSTALLED}") from error
        self._flashinfer = flashinfer
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, KV_LAYOUT)
        self._decode: dict[bool, Any] = {}  # use_tensor_cores -> decode wrapper, made on first use
        self._plan: PagedKvPlan | None = None
        self._planned: tuple[_Signature, Any] | None = None  # this step's planned signature and wrapper
        self.plans = 0  # wrapper plans so far (tests: one per step)

    def kv_cache_shapes(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """FlashInfer's NHD pages, keys and values apart: ``[blocks, block_size, kv_heads, head_dim]``."""
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return shape, shape

    def prepare(self, meta: AttentionMetadata) -> None:
        self._plan = paged_kv_plan(meta)
        self._planned = None  # the wrapper is planned for this step on the first forward

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        plan = self._plan
        assert plan is not None, "prepare() must run before forward()"
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        assert num_tokens == plan.num_tokens, f"{num_tokens} query rows, the step has {plan.num_tokens}"
        assert k_cache.shape[1] == plan.page_size and k_cache.shape[3] == head_dim
        assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
        assert q.dtype == k_cache.dtype == v_cache.dtype, "q and the caches must share a dtype"
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, plan.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, plan.slot_mapping, v)
        if plan.num_seqs == 0 or num_tokens == 0:
            return torch.empty_like(q)
        if q.stride(-1) != 1:
            q = q.contiguous()
        wrapper = self._wrapper_for(_Signature(num_heads, num_kv_heads, head_dim, q.dtype, float(scale)))
        return wrapper.run(q, (k_cache, v_cache))

    def _wrapper_for(self, sig: _Signature) -> Any:
        """The wrapper planned for this step and ``sig``: planned now unless an earlier layer did."""
        if self._planned is not None and self._planned[0] == sig:
            return self._planned[1]
        plan = self._plan
        assert plan is not None
        table = (plan.paged_kv_indptr, plan.paged_kv_indices, plan.paged_kv_last_page_len)
        if plan.decode_only:
            wrapper = self._decode_wrapper(sig.num_qo_heads // sig.num_kv_heads > CUDA_CORE_DECODE_MAX_GROUP)
            wrapper.plan(*table, sig.num_qo_heads, sig.num_kv_heads, sig.head_dim, plan.page_size,
                         pos_encoding_mode="NONE", q_data_type=sig.dtype, kv_data_type=sig.dtype,
                         sm_scale=sig.scale)
        else:
            wrapper = self._prefill
            wrapper.plan(plan.qo_indptr, *table, sig.num_qo_heads, sig.num_kv_heads, sig.head_dim, plan.page_size,
                         causal=True, sm_scale=sig.scale, q_data_type=sig.dtype, kv_data_type=sig.dtype)
        self.plans += 1
        self._planned = (sig, wrapper)
        return wrapper

    def _decode_wrapper(self, use_tensor_cores: bool) -> Any:
        if use_tensor_cores not in self._decode:
            self._decode[use_tensor_cores] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, KV_LAYOUT, use_tensor_cores=use_tensor_cores)
        return self._decode[use_tensor_cores]
