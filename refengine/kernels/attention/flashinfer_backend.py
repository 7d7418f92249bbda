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

* ``prepare`` (once, before any layer) calls ``paged_kv_plan`` (``flashinfer_page_table.py``),
  a pure function of the ``AttentionMetadata``, for FlashInfer's CSR page table: ``qo_indptr`` (=
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

CUDA graphs (decode steps, ``model/cuda_graphs.py``), as FlashInfer documents them: one
decode wrapper per captured batch size, made with ``use_cuda_graph=True`` over the first rows
of fixed index buffers (``flashinfer_graph_buffers.py``); ``plan`` runs outside the graph and
copies the step's page table into those buffers; only ``run`` (and our KV write, which reads
the slots from a fixed buffer too) is captured. ``prepare_for_replay`` plans the wrapper of the
step's padded size. It needs the head counts, head dim, dtype and scale, which arrive with the
tensors: the first capture's eager warm-up learns them (its ``forward`` plans, outside any
capture); from then on every ``prepare_for_replay`` plans at once, so a recorded or replayed
``forward`` never plans (it raises if it would, inside a capture). Each wrapper keeps its own
8 MiB integer workspace (and as much pinned host memory): about 320 MiB for the 20 sizes of 256
sequences. Graphed and eager decode are planned by FlashInfer's graph-mode and ordinary planners,
which may split the KV differently, so the two agree to rounding, not necessarily bit for bit;
neither has run on a GPU in this repo yet.

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
from refengine.kernels.attention.flashinfer_graph_buffers import FlashInferGraphBuffers
from refengine.kernels.attention.flashinfer_page_table import PagedKvPlan, paged_kv_plan
from refengine.kernels.attention.graph_buffers import CapturableBackend, graph_device

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
class _Signature:
    """What a wrapper's ``plan`` depends on besides the page table."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    scale: float


class FlashInferBackend(CapturableBackend, AttentionBackend):
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
        # Graph mode (see the module docstring).
        self._graph: FlashInferGraphBuffers | None = None
        self._graph_wrappers: dict[tuple[int, bool], Any] = {}  # (batch size, use_tensor_cores) -> wrapper
        self._graph_plan: PagedKvPlan | None = None  # the step prepare_for_replay loaded
        self._graph_signature: _Signature | None = None  # learned by the first capture's warm-up
        self._graph_planned: tuple[int, _Signature] | None = None  # the loaded step is planned for these

    def kv_cache_shapes(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """FlashInfer's NHD pages, keys and values apart: ``[blocks, block_size, kv_heads, head_dim]``."""
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return shape, shape

    def init_cuda_graph_state(self, max_num_seqs: int, max_num_blocks_per_seq: int,
                              device: torch.device | str | None = None) -> None:
        """The graph buffers, on ``device`` (None: the current CUDA device; tests pass the CPU and
        run graph mode eagerly, through a fake ``flashinfer``)."""
        self._graph = FlashInferGraphBuffers.allocate(max_num_seqs, max_num_blocks_per_seq, graph_device(device))
        self._graph_wrappers.clear()

    def prepare_for_replay(self, meta: AttentionMetadata) -> None:
        """Load the padded decode step: its slots into the buffer, its page table into the wrapper
        of its size through ``plan`` (at once when the signature is known, see the module docstring)."""
        assert self._graph is not None, "init_cuda_graph_state() must run before prepare_for_replay()"
        plan = paged_kv_plan(meta)
        assert plan.decode_only, "graph replay takes decode-only steps"
        self._graph.slot_mapping[: plan.num_seqs].copy_(plan.slot_mapping)
        self._graph_plan, self._graph_planned = plan, None
        if self._graph_signature is not None:
            self._plan_graph_wrapper(self._graph_signature)

    def prepare(self, meta: AttentionMetadata) -> None:
        self._graph_rows = None  # an eager step
        self._plan = paged_kv_plan(meta)
        self._planned = None  # the wrapper is planned for this step on the first forward

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        plan = self._plan if self._graph_rows is None else self._graph_plan
        assert plan is not None, "prepare() (or prepare_for_replay()) must run before forward()"
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        assert num_tokens == plan.num_tokens, f"{num_tokens} query rows, the step has {plan.num_tokens}"
        assert k_cache.shape[1] == plan.page_size and k_cache.shape[3] == head_dim
        assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
        assert q.dtype == k_cache.dtype == v_cache.dtype, "q and the caches must share a dtype"
        slots = plan.slot_mapping if self._graph_rows is None else self._graph_slots(num_tokens)
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)
        if plan.num_seqs == 0 or num_tokens == 0:
            return torch.empty_like(q)
        if q.stride(-1) != 1:
            q = q.contiguous()
        sig = _Signature(num_heads, num_kv_heads, head_dim, q.dtype, float(scale))
        wrapper = self._wrapper_for(sig) if self._graph_rows is None else self._graph_wrapper_for(sig, q)
        return wrapper.run(q, (k_cache, v_cache))

    def _wrapper_for(self, sig: _Signature) -> Any:
        """The wrapper planned for this step and ``sig``: planned now unless an earlier layer did."""
        if self._planned is not None and self._planned[0] == sig:
            return self._planned[1]
        plan = self._plan
        assert plan is not None
        if plan.decode_only:
            wrapper = self._decode_wrapper(_tensor_cores(sig))
            _plan_decode(wrapper, plan, sig)
        else:
            wrapper = self._prefill
            wrapper.plan(plan.qo_indptr, plan.paged_kv_indptr, plan.paged_kv_indices, plan.paged_kv_last_page_len,
                         sig.num_qo_heads, sig.num_kv_heads, sig.head_dim, plan.page_size, causal=True,
                         sm_scale=sig.scale, q_data_type=sig.dtype, kv_data_type=sig.dtype)
        self._planned = (sig, wrapper)
        return wrapper

    def _decode_wrapper(self, use_tensor_cores: bool) -> Any:
        if use_tensor_cores not in self._decode:
            self._decode[use_tensor_cores] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, KV_LAYOUT, use_tensor_cores=use_tensor_cores)
        return self._decode[use_tensor_cores]

    # -------------------------------------------------------------------------- graph mode

    def _graph_slots(self, num_tokens: int) -> torch.Tensor:
        assert self._graph is not None and self._graph_rows == num_tokens, "graph mode runs the captured batch"
        return self._graph.slot_mapping[:num_tokens]

    def _graph_wrapper_for(self, sig: _Signature, q: torch.Tensor) -> Any:
        """The graph wrapper of the loaded step's size, planned: only the first capture's warm-up
        plans here; a capture that would plan raises (its plan would be baked into the graph)."""
        plan = self._graph_plan
        assert plan is not None and plan.num_seqs == self._graph_rows
        if self._graph_planned != (plan.num_seqs, sig):
            if q.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("FlashInfer would plan inside a CUDA graph capture: "
                                   "prepare_for_replay() must plan the step before it is captured or replayed")
            self._graph_signature = sig
            self._plan_graph_wrapper(sig)
        return self._graph_wrappers[(plan.num_seqs, _tensor_cores(sig))]

    def _plan_graph_wrapper(self, sig: _Signature) -> None:
        """Plan the loaded step into the graph wrapper of its size (made on first use)."""
        plan, graph = self._graph_plan, self._graph
        assert plan is not None and graph is not None
        key = (plan.num_seqs, _tensor_cores(sig))
        if key not in self._graph_wrappers:
            self._graph_wrappers[key] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, KV_LAYOUT, use_cuda_graph=True, use_tensor_cores=key[1],
                **graph.wrapper_buffers(plan.num_seqs))
        _plan_decode(self._graph_wrappers[key], plan, sig)
        self._graph_planned = (plan.num_seqs, sig)


def _tensor_cores(sig: _Signature) -> bool:
    """Whether the decode of ``sig`` runs on the tensor cores (GQA groups wider than the CUDA-core kernel's)."""
    return sig.num_qo_heads // sig.num_kv_heads > CUDA_CORE_DECODE_MAX_GROUP


def _plan_decode(wrapper: Any, plan: PagedKvPlan, sig: _Signature) -> None:
    wrapper.plan(plan.paged_kv_indptr, plan.paged_kv_indices, plan.paged_kv_last_page_len, sig.num_qo_heads,
                 sig.num_kv_heads, sig.head_dim, plan.page_size, pos_encoding_mode="NONE", q_data_type=sig.dtype,
                 kv_data_type=sig.dtype, sm_scale=sig.scale)
