"""The FlashInfer attention backend (kernels/attention/flashinfer_backend.py).

On any machine: ``paged_kv_plan`` (the step's page table in FlashInfer's terms) against
hand-computed values and the slot invariant; the backend's calls (one ``plan`` per step,
the wrapper chosen, the arguments) through a fake ``flashinfer`` module whose ``run``
evaluates the planned page table as FlashInfer's documentation describes it (CSR pages,
``kv_len = page_size * (pages - 1) + last_page_len``, bottom-right causal mask), compared
with the torch reference; the registry entry; importing without FlashInfer.

On a CUDA machine with FlashInfer installed (``gpu``): the real kernels against the torch
reference in fp16 and bf16. The first run may JIT-compile FlashInfer's kernels (minutes).
"""

from __future__ import annotations

import importlib.util
import math
import random
import subprocess
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

from refengine.config import KernelConfig
from refengine.kernels.attention import flashinfer_backend, registry
from refengine.kernels.attention.base import AttentionMetadata
from refengine.kernels.attention.flashinfer_backend import FlashInferBackend, paged_kv_plan
from refengine.kernels.attention.torch_ref import TorchReferenceBackend

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
CUDA_REASON = flashinfer_backend.flashinfer_unavailable_reason(torch.float16, "cuda")  # "" on a GPU machine
GARBAGE = 50.0  # scale of never-written cache slots: reading one would show


def step_meta(tables: list[list[int]], shape: list[tuple[int, int]], block_size: int) -> AttentionMetadata:
    """Sequences ``(context, new)`` over the given block-table rows (padded with 0)."""
    starts = [0]
    for _, new in shape:
        starts.append(starts[-1] + new)
    block_tables = torch.zeros(len(tables), max((len(t) for t in tables), default=0), dtype=torch.int64)
    for i, table in enumerate(tables):
        block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int64)
    slots = [table[p // block_size] * block_size + p % block_size
             for (context, new), table in zip(shape, tables, strict=True) for p in range(context, context + new)]
    return AttentionMetadata(starts, [c + n for c, n in shape], block_tables, torch.tensor(slots, dtype=torch.int64),
                             block_size)


# ----------------------------------------------------------------------------- paged_kv_plan


def test_plan_of_a_ragged_step_by_hand() -> None:
    """Block size 4: a fresh 6-token prefill (2 pages, last holds 2); a 3-token chunk after
    5 cached tokens ending exactly on a block boundary (2 pages, last full; the table's
    spare third block is not a page yet); decode rows at a block's first row (9 tokens),
    mid-block (3) and its last row (4). Block ids shuffled and non-contiguous."""
    tables = [[7, 2], [5, 0, 11], [1, 8, 6], [10], [3]]
    shape = [(0, 6), (5, 3), (8, 1), (2, 1), (3, 1)]
    plan = paged_kv_plan(step_meta(tables, shape, block_size=4))
    assert plan.qo_indptr.tolist() == [0, 6, 9, 10, 11, 12]
    assert plan.paged_kv_indptr.tolist() == [0, 2, 4, 7, 8, 9]
    assert plan.paged_kv_indices.tolist() == [7, 2, 5, 0, 1, 8, 6, 10, 3]
    assert plan.paged_kv_last_page_len.tolist() == [2, 4, 1, 3, 4]
    for tensor in (plan.qo_indptr, plan.paged_kv_indptr, plan.paged_kv_indices, plan.paged_kv_last_page_len):
        assert tensor.dtype == torch.int32 and tensor.device.type == "cpu"
    assert (plan.page_size, plan.num_tokens, plan.num_seqs, plan.decode_only) == (4, 12, 5, False)


def test_plan_of_a_decode_only_step() -> None:
    """One-token queries only (a one-token prompt counts): the decode wrapper's step."""
    plan = paged_kv_plan(step_meta([[4, 9], [2], [6]], [(16, 1), (0, 1), (6, 1)], block_size=16))
    assert plan.decode_only
    assert plan.paged_kv_indptr.tolist() == [0, 2, 3, 4]
    assert plan.paged_kv_indices.tolist() == [4, 9, 2, 6]
    assert plan.paged_kv_last_page_len.tolist() == [1, 1, 7]


def test_plan_with_one_token_blocks_and_a_prefill_filling_whole_blocks() -> None:
    plan = paged_kv_plan(step_meta([[3, 1, 4], [0, 2]], [(1, 2), (0, 2)], block_size=1))
    assert plan.paged_kv_indptr.tolist() == [0, 3, 5]
    assert plan.paged_kv_indices.tolist() == [3, 1, 4, 0, 2]
    assert plan.paged_kv_last_page_len.tolist() == [1, 1]
    plan = paged_kv_plan(step_meta([[5, 6, 7]], [(0, 24)], block_size=8))
    assert (plan.paged_kv_indptr.tolist(), plan.paged_kv_last_page_len.tolist()) == ([0, 3], [8])
    assert not plan.decode_only


def test_plan_of_an_empty_step() -> None:
    meta = AttentionMetadata([0], [], torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), 16)
    plan = paged_kv_plan(meta)
    assert plan.num_seqs == 0 and plan.num_tokens == 0 and not plan.decode_only
    assert plan.qo_indptr.tolist() == [0] and plan.paged_kv_indptr.tolist() == [0]
    assert plan.paged_kv_indices.numel() == 0


@pytest.mark.parametrize("seed", range(5))
def test_plan_pages_hold_every_position_at_its_slot(seed: int) -> None:
    """Random ragged steps: FlashInfer's view (page ``indices[indptr[i] + p // bs]``, row
    ``p % bs``, ``kv_len = bs * (pages - 1) + last``) puts each sequence's length where
    the metadata does and each new token at its ``slot_mapping`` slot."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 3, 4, 16])
    shape = [(rng.randrange(0, 40), rng.randrange(1, 12) if rng.random() < 0.5 else 1) for _ in range(6)]
    needed = [math.ceil((c + n) / block_size) + rng.randrange(0, 2) for c, n in shape]  # some spare blocks
    ids = list(range(sum(needed) + 4))
    rng.shuffle(ids)
    tables = [ids[sum(needed[:i]) : sum(needed[: i + 1])] for i in range(len(shape))]
    meta = step_meta(tables, shape, block_size)
    plan = paged_kv_plan(meta)
    indptr, indices = plan.paged_kv_indptr.tolist(), plan.paged_kv_indices.tolist()
    last = plan.paged_kv_last_page_len.tolist()
    slots = iter(meta.slot_mapping.tolist())
    for i, (context, new) in enumerate(shape):
        pages = indices[indptr[i] : indptr[i + 1]]
        assert 1 <= last[i] <= block_size
        assert block_size * (len(pages) - 1) + last[i] == context + new == meta.seq_lens[i]
        assert pages == tables[i][: len(pages)]
        for p in range(context, context + new):
            assert pages[p // block_size] * block_size + p % block_size == next(slots)
    assert plan.qo_indptr.tolist() == meta.query_start_loc


@pytest.mark.parametrize(("meta", "message"), [
    (AttentionMetadata([0, 1], [5], torch.tensor([[1]]), torch.tensor([4]), 4), "need 2 blocks, the table has 1"),
    (AttentionMetadata([0, 3], [2], torch.zeros(1, 1, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), 4),
     "query length 3 with 2 tokens"),
    (AttentionMetadata([0, 2], [2], torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 4),
     "1 slots for 2 query tokens"),
    (AttentionMetadata([0, 2, 3], [2], torch.zeros(1, 1, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), 4),
     "bad step layout"),
], ids=["short-table", "query-longer-than-sequence", "slot-count", "starts-length"])
def test_plan_rejects_broken_metadata(meta: AttentionMetadata, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        paged_kv_plan(meta)


# ----------------------------------------------------------------------------- a step, run by two backends


def make_step(shape: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
              dtype: torch.dtype, device: str, seed: int, layer: int = 0):
    """Sequences ``(context, new)``, shuffled block ids with spares in between; caches with
    the context written and garbage elsewhere; q/k/v views of one fused tensor (as the
    model passes them). Returns the metadata, q, k, v, the caches and the scale. ``seed``
    fixes the block tables (so the metadata), ``layer`` varies the data under them."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(1000 * seed + layer)
    needed = [math.ceil((c + n) / block_size) for c, n in shape]
    num_blocks = sum(needed) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = [ids[sum(needed[:i]) : sum(needed[: i + 1])] for i in range(len(shape))]
    kv_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(kv_shape, generator=gen) * GARBAGE
    v_cache = torch.randn(kv_shape, generator=gen) * GARBAGE
    for (context, _), table in zip(shape, tables, strict=True):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(context)],
                             dtype=torch.int64)
        for cache in (k_cache, v_cache):
            cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(context, num_kv_heads, head_dim, generator=gen)
    meta = step_meta(tables, shape, block_size)
    meta = AttentionMetadata(meta.query_start_loc, meta.seq_lens, meta.block_tables.to(device),
                             meta.slot_mapping.to(device), block_size)
    qkv = torch.randn(meta.query_start_loc[-1], num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    q, k, v = qkv.to(device, dtype).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    return meta, q, k, v, k_cache.to(device, dtype), v_cache.to(device, dtype), 1.0 / math.sqrt(head_dim)


# A fresh prefill crossing a block boundary, a chunk continuing a cached context that
# crosses blocks, decode rows at a block's first row, its last row and mid-block.
RAGGED = [(0, 21), (19, 14), (16, 1), (15, 1), (40, 1)]
DECODES = [(16, 1), (15, 1), (40, 1), (0, 1), (77, 1)]


# ----------------------------------------------------------------------------- a fake flashinfer (CPU)


def documented_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               qo_indptr: list[int], table: tuple[torch.Tensor, ...], page_size: int,
                               scale: float, causal: bool) -> torch.Tensor:
    """Attention over a FlashInfer page table as its docs define it, in float32, slowly."""
    indptr, indices, last = (t.tolist() for t in table)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32)
    for i in range(len(last)):
        pages = torch.tensor(indices[indptr[i] : indptr[i + 1]], dtype=torch.int64)
        kv_len = page_size * (len(pages) - 1) + last[i]
        keys = k_cache.cpu()[pages].reshape(-1, num_kv_heads, head_dim)[:kv_len].float()
        values = v_cache.cpu()[pages].reshape(-1, num_kv_heads, head_dim)[:kv_len].float()
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        rows = slice(qo_indptr[i], qo_indptr[i + 1])
        queries = q.cpu()[rows].float()
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        if causal:  # bottom-right: query r sees kv positions <= kv_len - qo_len + r
            qo_len = queries.shape[0]
            allowed = torch.arange(kv_len)[None, :] <= torch.arange(qo_len)[:, None] + kv_len - qo_len
            scores = scores.masked_fill(~allowed, float("-inf"))
        out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out.to(q.dtype)


class FakeWrapper:
    """Records its calls in ``log`` and checks the documented argument contract."""

    log: list[tuple[str, ...]] = []

    def __init__(self, workspace: torch.Tensor, kv_layout: str, use_tensor_cores: bool = False) -> None:
        assert workspace.dtype == torch.uint8 and workspace.numel() > 0 and kv_layout == "NHD"
        self.use_tensor_cores = use_tensor_cores
        self.planned: dict | None = None

    def _check_table(self, qo_indptr, indptr, indices, last, num_qo_heads, num_kv_heads, page_size) -> None:
        for tensor in (qo_indptr, indptr, indices, last):
            assert tensor.dtype == torch.int32, "FlashInfer's index arrays must be int32"
        assert qo_indptr.device.type == indptr.device.type == last.device.type == "cpu"
        assert len(qo_indptr) == len(indptr) == len(last) + 1 and int(indptr[-1]) == len(indices)
        assert bool(((last >= 1) & (last <= page_size)).all()), "1 <= last_page_len <= page_size"
        assert num_qo_heads % num_kv_heads == 0

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        assert self.planned is not None, "run before plan"
        k_cache, v_cache = paged_kv_cache
        p = self.planned
        if p["table"] is None:  # graph mode: what the buffers hold now, as a captured run reads them
            indptr, indices, last = self.graph_buffers
            p = {**p, "table": (indptr, indices[: int(indptr[-1])], last)}
        assert q.dtype == p["q_data_type"] and k_cache.dtype == v_cache.dtype == p["kv_data_type"]
        assert q.shape[0] == int(p["qo_indptr"][-1]) and q.shape[1:] == (p["num_qo_heads"], p["head_dim"])
        assert k_cache.shape[1:] == (p["page_size"], p["num_kv_heads"], p["head_dim"])
        self.log.append((type(self).__name__, "run"))
        return documented_paged_attention(q, k_cache, v_cache, p["qo_indptr"].tolist(), p["table"], p["page_size"],
                                          p["sm_scale"], p["causal"]).to(q.device)


class FakePrefillWrapper(FakeWrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, *, causal=False, sm_scale=None, q_data_type="float16",
             kv_data_type=None) -> None:
        self._check_table(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                          num_kv_heads, page_size)
        self.planned = dict(qo_indptr=qo_indptr, table=(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len),
                            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim_qk,
                            page_size=page_size, causal=causal, sm_scale=sm_scale, q_data_type=q_data_type,
                            kv_data_type=kv_data_type or q_data_type)
        self.log.append(("prefill", "plan", str(causal)))


class FakeDecodeWrapper(FakeWrapper):
    """With ``use_cuda_graph``, as FlashInfer documents it: the batch size is fixed by the buffers
    given at construction, ``plan`` copies the page table into them, ``run`` reads only them."""

    def __init__(self, workspace: torch.Tensor, kv_layout: str, use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None) -> None:
        super().__init__(workspace, kv_layout, use_tensor_cores)
        self.graph_buffers = None
        if use_cuda_graph:
            buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
            assert all(torch.is_tensor(b) and b.dtype == torch.int32 for b in buffers), "cudagraph mode needs buffers"
            assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
            self.graph_buffers = buffers

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             pos_encoding_mode="NONE", q_data_type="float16", kv_data_type=None, sm_scale=None) -> None:
        qo_indptr = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._check_table(qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, page_size)
        assert pos_encoding_mode == "NONE"
        table = (indptr, indices, last_page_len)
        mode = "decode"
        if self.graph_buffers is not None:
            indptr_buf, indices_buf, last_buf = self.graph_buffers
            assert len(last_page_len) == len(last_buf), "the batch size is fixed in cudagraph mode"
            assert len(indices) <= len(indices_buf), "indices outgrow the buffer"
            indptr_buf.copy_(indptr)
            last_buf.copy_(last_page_len)
            indices_buf[: len(indices)].copy_(indices)
            table, mode = None, f"decode-graph-{len(last_buf)}"
        self.planned = dict(qo_indptr=qo_indptr, table=table, num_qo_heads=num_qo_heads,
                            num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, causal=False,
                            sm_scale=sm_scale, q_data_type=q_data_type, kv_data_type=kv_data_type or q_data_type)
        self.log.append((mode, "plan", f"tensor_cores={self.use_tensor_cores}"))


def num_plans(log: list[tuple[str, ...]]) -> int:
    """The wrapper plans recorded in a ``fake_flashinfer`` (or ``real_plans``) log."""
    return sum(entry[1] == "plan" for entry in log)


def real_plans(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """A log of the real FlashInfer wrappers' ``plan`` calls (the backend's per-step plans)."""
    import flashinfer

    log: list[tuple[str, ...]] = []
    for cls in (flashinfer.BatchPrefillWithPagedKVCacheWrapper, flashinfer.BatchDecodeWithPagedKVCacheWrapper):
        def plan(self: Any, *args: Any, _plan: Callable[..., Any] = cls.plan, **kwargs: Any) -> Any:
            log.append((type(self).__name__, "plan"))
            return _plan(self, *args, **kwargs)
        monkeypatch.setattr(cls, "plan", plan)
    return log


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = FakePrefillWrapper
    module.BatchDecodeWithPagedKVCacheWrapper = FakeDecodeWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    log: list[tuple[str, ...]] = []
    monkeypatch.setattr(FakeWrapper, "log", log)
    return log


def run_step(backend, shape, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed, layers=2,
             tol=1e-5, reference_dtype=None):
    """Both backends run ``layers`` layers of one step (own caches per layer, one prepare);
    outputs and the caches after the write must agree."""
    reference = TorchReferenceBackend()
    steps = [make_step(shape, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed, layer)
             for layer in range(layers)]
    meta = steps[0][0]
    assert all(step[0].slot_mapping.equal(meta.slot_mapping) for step in steps)  # one step, several layers
    reference.prepare(meta)
    backend.prepare(meta)
    for _, q, k, v, k_cache, v_cache, scale in steps:
        ref_dtype = reference_dtype or dtype
        ref_k, ref_v = k_cache.to(ref_dtype, copy=True), v_cache.to(ref_dtype, copy=True)
        expected = reference.forward(q.to(ref_dtype), k.to(ref_dtype), v.to(ref_dtype), ref_k, ref_v, scale)
        got = backend.forward(q, k, v, k_cache, v_cache, scale)
        assert got.shape == q.shape and got.dtype == q.dtype
        assert torch.equal(k_cache.to(ref_dtype), ref_k) and torch.equal(v_cache.to(ref_dtype), ref_v), \
            "the cache write differs"
        torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), [
    (2, 2, 16, 4), (6, 2, 8, 16), (8, 1, 16, 8),
], ids=["g1-b4", "g3-b16", "g8-b8"])
def test_fake_flashinfer_step_matches_reference(fake_flashinfer, num_heads: int, num_kv_heads: int,
                                                head_dim: int, block_size: int) -> None:
    """A mixed step plans the prefill wrapper (causal) once for all layers; a decode-only
    step plans a decode wrapper once (tensor cores for groups over 4); both match."""
    backend = FlashInferBackend(device="cpu", workspace_bytes=1024)
    run_step(backend, RAGGED, num_heads, num_kv_heads, head_dim, block_size, torch.float32, "cpu", seed=1, layers=3)
    assert fake_flashinfer == [("prefill", "plan", "True")] + [("FakePrefillWrapper", "run")] * 3
    fake_flashinfer.clear()
    run_step(backend, DECODES, num_heads, num_kv_heads, head_dim, block_size, torch.float32, "cpu", seed=2)
    tensor_cores = num_heads // num_kv_heads > flashinfer_backend.CUDA_CORE_DECODE_MAX_GROUP
    assert fake_flashinfer == [("decode", "plan", f"tensor_cores={tensor_cores}")] + [("FakeDecodeWrapper", "run")] * 2


def test_fake_flashinfer_replans_per_step_and_per_signature(fake_flashinfer) -> None:
    backend = FlashInferBackend(device="cpu", workspace_bytes=1024)
    meta, q, k, v, k_cache, v_cache, scale = make_step(RAGGED, 4, 2, 8, 4, torch.float32, "cpu", seed=3)
    for _ in range(2):  # a new step plans again, even for the same shapes
        backend.prepare(meta)
        backend.forward(q, k, v, k_cache, v_cache, scale)
        backend.forward(q, k, v, k_cache, v_cache, scale)
    assert num_plans(fake_flashinfer) == 2
    backend.forward(q, k, v, k_cache, v_cache, scale * 2)  # another softmax scale: a new plan
    assert num_plans(fake_flashinfer) == 3
    backend.prepare(AttentionMetadata([0], [], torch.zeros(0, 1, dtype=torch.int64),
                                      torch.zeros(0, dtype=torch.int64), 4))
    empty = backend.forward(q[:0], k[:0], v[:0], k_cache, v_cache, scale)
    assert empty.shape == (0, 4, 8) and num_plans(fake_flashinfer) == 3  # nothing to plan for an empty step
    assert [entry for entry in fake_flashinfer if entry[1] == "plan"] == [("prefill", "plan", "True")] * 3


# ----------------------------------------------------------------------------- registry and imports


def test_flashinfer_comes_first_in_auto_preference() -> None:
    """Where nothing but the torch reference runs (float16 on the CPU), ``auto`` says why it skipped
    each backend before it, in the order it tried them."""
    chosen, why = registry.choose_backend("auto", torch.float16, "cpu", KernelConfig())
    assert chosen == "torch", why
    assert why.index("flashinfer: ") < why.index("triton: ") < why.index("cpu: "), why


@pytest.mark.skipif(HAS_FLASHINFER and torch.cuda.is_available(), reason="checks a machine that cannot run it")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_flashinfer_unavailable_here_and_auto_unchanged_on_cpu(dtype: torch.dtype) -> None:
    kernels = KernelConfig()
    assert registry.unavailable_reason("flashinfer", dtype, "cpu", kernels) == "it needs CUDA, not cpu"
    cuda_reason = registry.unavailable_reason("flashinfer", dtype, "cuda", kernels)
    if not HAS_FLASHINFER:
        assert cuda_reason == "flashinfer is not installed (pip install 'refengine[gpu]')"
    else:
        assert "CUDA is not available" in cuda_reason
    for device in ("cpu", "cuda"):
        with pytest.raises(ValueError, match="attention backend 'flashinfer' is unavailable"):
            registry.make_attention_backend("flashinfer", dtype, device, kernels)
    available = registry.available_backends(dtype, "cpu", kernels)
    assert "flashinfer" not in available and "triton" not in available
    expected = "cpu" if not registry.unavailable_reason("cpu", dtype, "cpu", kernels) else "torch"
    assert available[0] == expected
    chosen = registry.make_attention_backend("auto", dtype, "cpu", kernels)
    assert type(chosen) is type(registry.make_attention_backend(expected, dtype, "cpu", kernels))


def test_unavailable_reasons_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Device first, then the package, then CUDA itself, then the dtype."""
    reason = flashinfer_backend.flashinfer_unavailable_reason
    monkeypatch.setattr(flashinfer_backend, "flashinfer_installed", lambda: False)
    assert reason(torch.float16, "cpu") == "it needs CUDA, not cpu"
    assert reason(torch.float16, "cuda:0") == flashinfer_backend.NOT_INSTALLED
    monkeypatch.setattr(flashinfer_backend, "flashinfer_installed", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert reason(torch.float16, "cuda") == "it needs CUDA, and CUDA is not available on this machine"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert reason(torch.float32, "cuda") == "it needs float16 or bfloat16, not torch.float32"
    assert reason(torch.float16, "cuda") == reason(torch.bfloat16, "cuda") == ""
    assert registry.unavailable_reason("flashinfer", torch.bfloat16, "cuda", KernelConfig()) == ""


def test_without_flashinfer_the_backend_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer fails, find_spec finds nothing
    assert flashinfer_backend.flashinfer_unavailable_reason(torch.float16, "cuda") == flashinfer_backend.NOT_INSTALLED
    with pytest.raises(RuntimeError, match=r"flashinfer is not installed \(pip install 'refengine\[gpu\]'\)"):
        FlashInferBackend(device="cpu")


def test_importing_and_checking_never_imports_flashinfer() -> None:
    code = ("import sys, torch\n"
            "from refengine.config import KernelConfig\n"
            "from refengine.kernels.attention import flashinfer_backend, registry\n"
            "for dtype in (torch.float16, torch.float32):\n"
            "    for device in ('cpu', 'cuda'):\n"
            "        registry.unavailable_reason('flashinfer', dtype, device, KernelConfig())\n"
            "        registry.available_backends(dtype, device, KernelConfig())\n"
            "registry.make_attention_backend('auto', torch.float32, 'cpu')\n"
            "assert 'flashinfer' not in sys.modules, 'flashinfer was imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]


# ----------------------------------------------------------------------------- the real kernels (CUDA)


@pytest.mark.gpu
@pytest.mark.skipif(bool(CUDA_REASON), reason=f"FlashInfer cannot run here: {CUDA_REASON}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), [
    (4, 4, 64, 16),  # MHA
    (9, 3, 64, 16),  # SmolLM2's heads: group 3 (CUDA-core decode)
    (16, 2, 128, 32),  # group 8 (tensor-core decode)
], ids=["g1-d64-b16", "g3-d64-b16", "g8-d128-b32"])
def test_flashinfer_matches_reference_on_cuda(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, num_heads: int,
                                              num_kv_heads: int, head_dim: int, block_size: int) -> None:
    """A mixed step (prefill wrapper), a decode-only step (decode wrapper) and a longer
    mixed step, each over two layers with one plan; the reference runs in float32 on the
    same (rounded) inputs."""
    assert flashinfer_backend.flashinfer_unavailable_reason(dtype, "cuda") == ""
    backend = registry.make_attention_backend("auto", dtype, "cuda")
    assert isinstance(backend, FlashInferBackend)
    tol = 1e-2 if dtype == torch.float16 else 3e-2
    cases = [RAGGED, DECODES, [(0, 300), (700, 130), (5, 1), (511, 1), (2000, 1)]]
    log = real_plans(monkeypatch)
    for seed, shape in enumerate(cases):
        plans = num_plans(log)
        run_step(backend, shape, num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda", seed=10 * seed,
                 tol=tol, reference_dtype=torch.float32)
        assert num_plans(log) == plans + 1  # one plan for both layers
    torch.cuda.synchronize()
