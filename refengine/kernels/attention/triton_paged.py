"""The Triton attention backend (CUDA): paged attention over the default cache layout
``[num_blocks, block_size, num_kv_heads, head_dim]``, one launch per layer for a whole
step (prefill chunks with or without cached context and decode rows together).

The kernels (``store_kv``, ``paged_attention`` with its split-KV variant, ``combine_splits``),
their work decomposition, precision and the invariants they rely on are described in
``triton_paged_kernels.py``. This module is the host side: ``prepare`` uploads the step's int32
index tensors (query starts, lengths, block tables, slots, work list) once and decides split-KV,
so ``forward`` (once per layer) only launches kernels.

Split-KV heuristic (``split_kv_plan``): a decode-only step whose longest context exceeds
``SPLIT_KV_MIN_BLOCKS`` cache blocks, with ``num_splits = min(MAX_KV_SPLITS, ceil(longest /
partition_tokens))``; the constructor can force it on (any step; tests) or off.

CUDA graphs (decode steps, ``model/cuda_graphs.py``): graph mode reads the fixed buffers of
``triton_graph_buffers.py`` instead of ``prepare``'s tensors, and its launch shapes are those of
an eager decode-only step of the same batch (one query row per work item), so a replayed row
computes what the eager step computes, bit for bit. The one difference would be split-KV, whose
grid depends on the step's longest context: graphs are captured unsplit, and a step that the
eager path would split runs eagerly (``graph_step_ineligible_reason``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from refengine.kernels.attention.base import AttentionBackend, AttentionMetadata
from refengine.kernels.attention.graph_buffers import CapturableBackend, graph_device
from refengine.kernels.attention.triton_graph_buffers import TritonGraphBuffers
from refengine.kernels.attention.triton_paged_kernels import combine_splits, paged_attention, store_kv

try:
    import triton
except ImportError:  # a CPU-only install: the module still imports, triton_available() is False
    triton = None

_NO_TABLES = torch.empty(0, dtype=torch.int64)  # split_kv_plan reads lengths only (graph_step_ineligible_reason)
SPLIT_KV_MIN_BLOCKS = 64  # a decode-only step splits when its longest context exceeds this many cache blocks
PARTITION_TOKENS = 512  # the key positions one split covers, at least (rounded up to whole KV tiles)
MAX_KV_SPLITS = 16
MAX_QUERY_TILE = 16  # query rows of one sequence per program in a step with prefill chunks
MAX_ROWS = 128  # query rows x heads stacked in one program's tile, at most
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def triton_available() -> bool:
    """True when Triton can be imported (callers still choose CUDA tensors for it)."""
    return triton is not None


#: The oldest torch and Triton these kernels are written for (the GPU machines' image: torch 2.11, Triton 3.6).
MIN_VERSIONS = {"torch": (2, 11), "triton": (3, 6)}


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2] if part.isdigit())


def stack_too_old() -> str:
    """What is too old in this torch/Triton pair for the kernels; "" when both are new enough."""
    found = {"torch": torch.__version__, "triton": triton.__version__ if triton is not None else "0"}
    old = [f"{name} {found[name]} (needs >= {'.'.join(map(str, need))})" for name, need in MIN_VERSIONS.items()
           if _version(found[name]) < need]
    return f"too old: {', '.join(old)}" if old else ""


def unavailable_reason(dtype: torch.dtype, device: str) -> str:
    """Why this backend cannot run for ``dtype`` on ``device``; "" when it can."""
    if torch.device(device).type != "cuda":
        return f"it needs CUDA, not {device} (Triton kernels run on the CPU only under TRITON_INTERPRET=1, for tests)"
    if not triton_available():
        return "triton is not installed"
    if old := stack_too_old():
        return old
    if not torch.cuda.is_available():
        return "CUDA is not available on this machine"
    if dtype not in DTYPES:
        return f"it needs float16, bfloat16 or float32, not {dtype}"
    return ""


def split_kv_plan(meta: AttentionMetadata, partition_tokens: int = PARTITION_TOKENS,
                  force: bool | None = None, tile: int = 64) -> tuple[int, int]:
    """``(num_splits, partition)`` for the step: ``(1, 0)`` = no split. Splits a decode-only
    step whose longest context exceeds ``SPLIT_KV_MIN_BLOCKS`` blocks (``force`` True: any
    step; False: never) into at most ``MAX_KV_SPLITS`` partitions of at least
    ``partition_tokens`` positions, rounded up to a multiple of ``tile`` (whole KV tiles: 64,
    or a wider ``LaunchConfig.block_n``)."""
    longest = max(meta.seq_lens, default=0)
    decode_only = all(meta.query_len(i) == 1 for i in range(meta.num_seqs))
    wanted = decode_only and -(-longest // meta.block_size) > SPLIT_KV_MIN_BLOCKS if force is None else force
    num_splits = min(MAX_KV_SPLITS, -(-longest // partition_tokens)) if wanted else 1
    if num_splits <= 1:
        return 1, 0
    partition = -(-longest // num_splits)
    partition = -(-partition // tile) * tile
    return -(-longest // partition), partition


@dataclass(frozen=True)
class LaunchConfig:
    """Overrides of the attention kernel's launch parameters; None keeps the heuristic in
    ``forward`` (``block_n``: key positions per tile, 64, or 32 for wide tiles; ``num_warps``: 4,
    or 8 for wide tiles; ``num_stages``: Triton's default software pipelining). Any choice
    computes the same attention (the tile size changes only the order of the online softmax's
    updates); ``benchmarks/gpu_check.py`` times a sweep of them on a GPU."""

    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_n", "num_warps"):
            value = getattr(self, name)
            if value is not None and (value < 1 or value & (value - 1)):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if self.block_n is not None and self.block_n < 16:
            raise ValueError(f"block_n must be at least 16 (tl.dot), got {self.block_n}")
        if self.num_stages is not None and self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")


@dataclass(frozen=True)
class _Step:
    """The per-step device tensors (int32) and launch shapes ``prepare`` derives once."""

    query_start_loc: torch.Tensor  # [num_seqs + 1]
    seq_lens: torch.Tensor  # [num_seqs]
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks]
    slot_mapping: torch.Tensor  # [num_tokens] int64, as given
    work_seq: torch.Tensor  # [num_work] the sequence of each work item
    work_row: torch.Tensor  # [num_work] its first query row within the sequence
    query_tile: int
    block_size: int
    num_splits: int
    partition: int


class TritonPagedBackend(CapturableBackend, AttentionBackend):
    """Paged attention in Triton (see the module docstring). ``split_kv``: None = the
    heuristic, True/False = always/never split; ``partition_tokens``: the split size floor;
    ``launch``: overrides of the attention kernel's launch parameters."""

    def __init__(self, split_kv: bool | None = None, partition_tokens: int = PARTITION_TOKENS,
                 launch: LaunchConfig | None = None) -> None:
        if triton is None:
            raise RuntimeError("TritonPagedBackend needs Triton; use the torch reference backend without it")
        self.split_kv = split_kv
        self.partition_tokens = partition_tokens
        self.launch = launch or LaunchConfig()
        self._split_tile = max(64, self.launch.block_n or 64)  # split partitions hold whole KV tiles
        self._step: _Step | None = None
        self._graph: TritonGraphBuffers | None = None

    def init_cuda_graph_state(self, max_num_seqs: int, max_num_blocks_per_seq: int,
                              device: torch.device | str | None = None) -> None:
        """The graph buffers, on ``device`` (None: the current CUDA device; the CPU only in tests,
        under the interpreter, which run graph mode eagerly)."""
        self._graph = TritonGraphBuffers.allocate(max_num_seqs, max_num_blocks_per_seq, graph_device(device))

    def prepare_for_replay(self, meta: AttentionMetadata) -> None:
        assert self._graph is not None, "init_cuda_graph_state() must run before prepare_for_replay()"
        self._graph.load(meta)

    def graph_step_ineligible_reason(self, seq_lens: list[int], block_size: int) -> str:
        decode = AttentionMetadata(list(range(len(seq_lens) + 1)), list(seq_lens), _NO_TABLES, _NO_TABLES, block_size)
        if split_kv_plan(decode, self.partition_tokens, self.split_kv, self._split_tile)[0] > 1:
            return "the eager step would split the KV (graphs are captured unsplit)"
        return ""

    def _graph_step(self, block_size: int) -> _Step:
        """Graph mode's step: the buffers' first rows, the launch shapes of an unsplit decode step."""
        graph, n = self._graph, self._graph_rows
        assert graph is not None and n is not None
        return _Step(query_start_loc=graph.query_start_loc[: n + 1], seq_lens=graph.seq_lens[:n],
                     block_tables=graph.block_tables[:n], slot_mapping=graph.slot_mapping[:n],
                     work_seq=graph.work_seq[:n], work_row=graph.work_row[:n], query_tile=1,
                     block_size=block_size, num_splits=1, partition=0)

    @property
    def num_splits(self) -> int:
        """The prepared step's number of KV splits (1 = no split-KV)."""
        assert self._step is not None, "prepare() must run first"
        return self._step.num_splits

    def prepare(self, meta: AttentionMetadata) -> None:
        self._graph_rows = None
        device = meta.block_tables.device
        query_lens = [meta.query_len(i) for i in range(meta.num_seqs)]
        num_splits, partition = split_kv_plan(meta, self.partition_tokens, self.split_kv, self._split_tile)
        longest_query = max(query_lens, default=1)
        query_tile = 1 if longest_query == 1 else min(MAX_QUERY_TILE, triton.next_power_of_2(longest_query))
        work = [(i, row) for i, n in enumerate(query_lens) for row in range(0, n, query_tile)]
        work_table = torch.tensor(work, dtype=torch.int32).reshape(-1, 2).t().contiguous().to(device)
        self._step = _Step(
            query_start_loc=torch.tensor(meta.query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(meta.seq_lens, dtype=torch.int32, device=device),
            block_tables=meta.block_tables.to(torch.int32).contiguous(),
            slot_mapping=meta.slot_mapping,
            work_seq=work_table[0], work_row=work_table[1],
            query_tile=query_tile, block_size=meta.block_size, num_splits=num_splits, partition=partition)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        step = self._step if self._graph_rows is None else self._graph_step(block_size=k_cache.shape[1])
        assert step is not None, "prepare() must run before forward()"
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        assert num_heads % num_kv_heads == 0 and k_cache.shape[3] == head_dim
        assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1, "rows must be contiguous in head_dim"
        # tl.dot needs K >= 16 on NVIDIA GPUs (the interpreter takes any): a head_dim under 16 is
        # padded there, the loads and stores masked by HEAD_DIM.
        head_dim_pad = max(16, triton.next_power_of_2(head_dim))
        store_kv[(num_tokens, num_kv_heads)](
            k, v, k_cache, v_cache, step.slot_mapping, step.block_size,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if step.work_seq.numel() == 0:
            return out
        group = num_heads // num_kv_heads
        heads_tile = min(triton.next_power_of_2(group), max(1, MAX_ROWS // step.query_tile))
        head_chunks = -(-group // heads_tile)
        block_m = max(16, step.query_tile * heads_tile)
        launch = self.launch
        block_n = launch.block_n or (64 if block_m * head_dim_pad <= 64 * 128 else 32)
        pipelining = {} if launch.num_stages is None else {"num_stages": launch.num_stages}
        splits = step.num_splits
        if splits > 1:
            part_acc = torch.empty(num_tokens * num_heads * splits, head_dim_pad, dtype=torch.float32, device=q.device)
            part_max = torch.empty(num_tokens * num_heads * splits, dtype=torch.float32, device=q.device)
            part_sum = torch.empty_like(part_max)
        else:
            part_acc = part_max = part_sum = out  # not read or written
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        paged_attention[(step.work_seq.numel(), num_kv_heads * head_chunks, splits)](
            q, k_cache, v_cache, out, part_acc, part_max, part_sum,
            step.block_tables, step.query_start_loc, step.seq_lens, step.work_seq, step.work_row,
            scale * math.log2(math.e), group, head_chunks, num_heads, splits, step.partition, step.block_size,
            step.block_tables.stride(0), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            *k_cache.stride()[:3], *v_cache.stride()[:3],
            QUERY_TILE=step.query_tile, HEADS_TILE=heads_tile, BLOCK_M=block_m, BLOCK_N=block_n,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, PRECISION=precision, SPLIT_KV=splits > 1,
            num_warps=launch.num_warps or (4 if block_m <= 64 else 8), **pipelining)
        if splits > 1:
            combine_splits[(num_tokens, num_heads)](
                out, part_acc, part_max, part_sum, num_heads, splits, out.stride(0), out.stride(1),
                SPLITS_PAD=triton.next_power_of_2(splits), HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad)
        return out
