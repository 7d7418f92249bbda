"""CUDA graphs for decode steps: capture once per padded batch size, replay per step.

A decode step launches the same few hundred small kernels every time, with only the
values of its inputs changing; on a GPU the launches, not the math, bound a small batch.
``DecodeGraphs`` records the decoder's forward pass for a decode batch of ``n`` sequences
into one CUDA graph per size in ``graph_sizes(max_num_seqs)`` and replays the smallest
one that fits, with the step copied into fixed input buffers. It follows nano-vllm and
mini-sglang: the runner owns capture and replay, the attention backend owns its own
buffers through the hooks of ``kernels/attention/base.py``.

When a step is replayed (``step_ineligible_reason`` returns ""): every sequence has
exactly one new token; the batch is no larger than the largest captured size; no token
uses a LoRA adapter (``LoraBatch`` groups a step's tokens by adapter on the host, with
Python-side segment counts and lengths that set the matmul shapes: a graph would bake in
one step's grouping); no row takes media embeddings (a per-step scatter of a
data-dependent number of rows); the block tables are no wider than
``max_num_blocks_per_seq``. The run as a whole must allow graphs first
(``graphs_unavailable_reason``): enabled (``KernelConfig.cuda_graphs``, ``--no-cuda-graphs``
turns it off), a CUDA device, and a backend whose ``supports_cuda_graphs`` is True. Any
other step runs eagerly, exactly as without graphs; CPU runs never build a
``DecodeGraphs``.

Padding (``padded_decode``): a batch of ``k`` real sequences replays the graph of
``n = padded_size(k)`` rows; rows ``k..n`` are placeholders: token 0 at position 0,
length 1, writing its key and value to the first slot of a scratch block that no
sequence owns (the runner allocates one block past the pool) and attending only to it.
Rows never mix in a decoder, so the real rows' results do not depend on the padding.

Capture, per size, largest first, all graphs sharing one memory pool: the backend's
``prepare_for_capture(n)`` (inside the recorded function, so it also runs for the eager
stand-in the CPU tests use), the placeholder step through ``prepare_for_replay``, one
eager warm-up run (compiles the Triton kernels, lets cuBLAS choose its algorithms; it
writes only the scratch slot), then the recorded run. The graph's output is the hidden
state of all ``n`` rows; the LM head runs eagerly on the rows that need logits.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from refengine.kernels.attention.base import AttentionBackend, AttentionMetadata
from refengine.kernels.forward_context import ForwardContext
from refengine.model.input import ModelInput
from refengine.model.llama import LlamaModel

logger = logging.getLogger(__name__)

SMALL_SIZES = (1, 2, 4, 8)  # then every multiple of SIZE_STEP, then max_num_seqs itself
SIZE_STEP = 16

#: A decoder forward over the graph buffers, returning its output tensor.
ForwardFn = Callable[[], torch.Tensor]


def graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The padded batch sizes captured: 1, 2, 4, 8, then multiples of 16, always ending at
    ``max_num_seqs`` so that every decode batch the scheduler can form has a graph."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = {s for s in SMALL_SIZES if s < max_num_seqs}
    sizes.update(range(SIZE_STEP, max_num_seqs, SIZE_STEP))
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


def padded_size(num_seqs: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest of ``sizes`` (ascending) that holds ``num_seqs`` rows; None when none does."""
    if num_seqs < 1:
        return None
    return next((s for s in sizes if s >= num_seqs), None)


def graphs_unavailable_reason(enabled: bool, device: str, attention: AttentionBackend) -> str:
    """Why a run may not use decode graphs at all; "" when it may (then the runner builds a
    ``DecodeGraphs``, capturing on the first eligible step)."""
    if not enabled:
        return "disabled (KernelConfig.cuda_graphs, --no-cuda-graphs)"
    if torch.device(device).type != "cuda":
        return f"device {device} is not CUDA"
    if not attention.supports_cuda_graphs:
        return f"attention backend {type(attention).__name__} cannot be captured (supports_cuda_graphs is False)"
    if not torch.cuda.is_available():
        return "CUDA is not available on this machine"
    return ""


def step_ineligible_reason(model_input: ModelInput, max_size: int, max_num_blocks_per_seq: int) -> str:
    """Why this step must run eagerly; "" when it may replay a graph (see the module docstring)."""
    n = model_input.num_seqs
    if n == 0:
        return "empty step"
    if model_input.query_start_loc != list(range(n + 1)):
        return "not decode-only (a sequence has more than one new token)"
    if n > max_size:
        return f"{n} sequences exceed the largest captured batch ({max_size})"
    if model_input.block_tables.shape[1] > max_num_blocks_per_seq:
        return f"block tables {model_input.block_tables.shape[1]} wide exceed the graphs' {max_num_blocks_per_seq}"
    if model_input.adapter_slots is not None and bool((model_input.adapter_slots >= 0).any()):
        return "LoRA adapter tokens (their per-step grouping sets the shapes)"
    if model_input.input_embeds is not None:
        return "media embeddings (a per-step scatter of rows)"
    return ""


@dataclass(frozen=True)
class PaddedDecode:
    """A decode step padded to a captured size, on the host: what the buffers receive."""

    input_ids: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n] int64
    meta: AttentionMetadata  # n one-token sequences; block_tables [n, max_num_blocks_per_seq]


def padded_decode(model_input: ModelInput | None, size: int, max_num_blocks_per_seq: int, block_size: int,
                  scratch_block: int) -> PaddedDecode:
    """``model_input``'s rows (None: no real rows, the capture placeholder) followed by
    placeholder rows up to ``size``: token 0 at position 0, length 1, slot and every block
    the scratch block's first. The table is as wide as the step's own (the graph buffers zero
    the columns past it): built ``max_num_blocks_per_seq`` wide, a long-context model's replay
    made and copied a 16.8 MB table a step at batch 256 (found by review)."""
    real = 0 if model_input is None else model_input.num_seqs
    assert 0 <= real <= size, f"{real} rows do not fit a batch of {size}"
    input_ids = torch.zeros(size, dtype=torch.int64)
    positions = torch.zeros(size, dtype=torch.int64)
    slots = torch.full((size,), scratch_block * block_size, dtype=torch.int64)
    width = 1 if model_input is None else max(1, model_input.block_tables.shape[1])
    assert width <= max_num_blocks_per_seq, f"a step {width} blocks wide outgrows the graphs' {max_num_blocks_per_seq}"
    tables = torch.zeros(size, width, dtype=torch.int64)
    tables[real:, 0] = scratch_block
    seq_lens = [1] * size
    if model_input is not None:
        input_ids[:real] = model_input.input_ids
        positions[:real] = model_input.positions
        slots[:real] = model_input.slot_mapping
        tables[:real, : model_input.block_tables.shape[1]] = model_input.block_tables
        seq_lens[:real] = model_input.seq_lens
    meta = AttentionMetadata(query_start_loc=list(range(size + 1)), seq_lens=seq_lens, block_tables=tables,
                             slot_mapping=slots, block_size=block_size)
    return PaddedDecode(input_ids, positions, meta)


class CudaGraphRecorder:
    """Records a forward function into a CUDA graph; all graphs share one memory pool."""

    def __init__(self) -> None:
        self.pool: object | None = None

    def capture(self, forward: ForwardFn) -> tuple[Callable[[], None], torch.Tensor]:
        """``(replay, output)``: ``replay()`` reruns the recorded kernels, refreshing ``output``.
        The warm-up runs on a side stream, as PyTorch's graph docs advise (Triton compiles and
        cuBLAS sets up there, not during capture). ``thread_local``: the engine's other threads
        (KV transfers) may keep using CUDA while a lazy capture runs."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            output = forward()
        if self.pool is None:
            self.pool = graph.pool()
        return graph.replay, output


class DecodeGraphs:
    """The decode graphs of one runner: capture (lazily, on the first eligible step, see
    ``run``) and replay. ``kv_caches`` are the full cache tensors, the scratch block
    included; ``recorder`` is the CUDA graph recorder (tests on CPU pass an eager stand-in)."""

    def __init__(self, model: LlamaModel, attention: AttentionBackend,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], *, device: str, max_num_seqs: int,
                 max_num_blocks_per_seq: int, block_size: int, scratch_block: int,
                 recorder: CudaGraphRecorder | None = None) -> None:
        self.model = model
        self.attention = attention
        self.kv_caches = kv_caches
        self.device = torch.device(device)
        self.sizes = graph_sizes(max_num_seqs)
        self.max_num_blocks_per_seq = max_num_blocks_per_seq
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.recorder = recorder or CudaGraphRecorder()
        self._replays: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self._input_ids: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self.num_replays = 0  # steps served by a graph, for tests and stats

    def ineligible_reason(self, model_input: ModelInput) -> str:
        return (step_ineligible_reason(model_input, self.sizes[-1], self.max_num_blocks_per_seq)
                or self.attention.graph_step_ineligible_reason(model_input.seq_lens, self.block_size))

    def capture(self) -> None:
        """Every size, largest first (the smaller graphs then reuse the shared pool's memory)."""
        start = time.perf_counter()
        max_size = self.sizes[-1]
        on_cuda = self.device.type == "cuda"
        with torch.cuda.device(self.device) if on_cuda else contextlib.nullcontext():  # the backend's buffers
            self.attention.init_cuda_graph_state(max_size, self.max_num_blocks_per_seq)
            self._input_ids = torch.zeros(max_size, dtype=torch.int64, device=self.device)
            self._positions = torch.zeros(max_size, dtype=torch.int64, device=self.device)
            for size in reversed(self.sizes):
                self._load(padded_decode(None, size, self.max_num_blocks_per_seq, self.block_size,
                                         self.scratch_block))
                self._replays[size] = self.recorder.capture(self._forward_fn(size))
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.2f s", len(self.sizes),
                    ", ".join(map(str, self.sizes)), time.perf_counter() - start)

    def _forward_fn(self, size: int) -> ForwardFn:
        assert self._input_ids is not None and self._positions is not None
        input_ids, positions = self._input_ids[:size], self._positions[:size]

        def forward() -> torch.Tensor:
            self.attention.prepare_for_capture(size)  # in graph mode the backend reads its own buffers
            return self.model.forward(input_ids, positions, ForwardContext(self.attention, self.kv_caches))
        return forward

    def _load(self, step: PaddedDecode) -> None:
        """Copy a padded step into the buffers (ours: token ids, positions; the backend's: the rest)."""
        assert self._input_ids is not None and self._positions is not None
        size = step.input_ids.numel()
        self._input_ids[:size].copy_(step.input_ids)
        self._positions[:size].copy_(step.positions)
        self.attention.prepare_for_replay(step.meta)

    def run(self, model_input: ModelInput) -> torch.Tensor:
        """Replay the step (eligible: ``ineligible_reason`` is ""), capturing first if no graph
        exists yet. Returns the hidden states ``[padded size, hidden]``: the step's rows first,
        then padding; valid until the next replay."""
        if not self._replays:
            self.capture()
        size = padded_size(model_input.num_seqs, self.sizes)
        assert size is not None, "run() takes eligible steps only"
        self._load(padded_decode(model_input, size, self.max_num_blocks_per_seq, self.block_size,
                                 self.scratch_block))
        replay, output = self._replays[size]
        replay()
        self.num_replays += 1
        return output
