"""The model runner: a ``ModelInput`` in, logits out.

Stateless over requests: it owns the weights and the KV cache tensors, runs the
model on the step's flat tensors (token ids, positions, slot mapping, block tables)
with one ``ForwardContext``, and returns logits only for the rows the engine needs.
It never sees a scheduler or request object.

CUDA graphs (``model/cuda_graphs.py``): when the run allows them (``graphs_unavailable``
is "": ``KernelConfig.cuda_graphs``, a CUDA device, a backend that supports capture) the
runner holds a ``DecodeGraphs`` and allocates one scratch KV block past the pool for its
padding rows (``kv_caches`` stay views of exactly ``num_blocks`` blocks). The graphs are
captured lazily, on the first graph-eligible decode step, not at construction: a run that
never decodes (a prefill-role engine, a test) pays nothing, and capture sees the same
allocator state as serving. Eligible steps then replay; every other step runs eagerly,
as before. On CPU ``graphs`` is None and nothing of this runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from refengine.config import CacheConfig, EngineConfig, KernelConfig, ModelConfig, SchedulerConfig
from refengine.kernels.attention import AttentionMetadata, TorchReferenceBackend, make_attention_backend
from refengine.kernels.attention.base import AttentionBackend
from refengine.kernels.forward_context import ForwardContext
from refengine.kernels.lora import LoraBatch
from refengine.kernels.lora_linear import ProjectionDeltas
from refengine.model.cuda_graphs import DecodeGraphs, graphs_unavailable_reason
from refengine.model.devices import check_kv_cache_fits, resolve_device
from refengine.model.dtypes import DTYPES
from refengine.model.host_memory import keep_freed_memory, zeroed_slab
from refengine.model.input import ModelInput
from refengine.model.llama import LlamaModel, LoraSlotShape


def kv_pool_blocks(config: ModelConfig, cache: CacheConfig, kv_dtype: torch.dtype) -> int:
    """The KV pool's blocks: ``cache.num_blocks``, else as many as ``kv_memory_bytes`` holds;
    ``ValueError`` when it holds none. From the flags and the model's config alone, so that
    ``Engine.from_config`` asks it before the weights load (found by review: a --block-size too
    large for the budget failed only after a whole load)."""
    block_bytes = kv_bytes_per_block(config, cache.block_size, kv_dtype)
    if cache.num_blocks is None and cache.kv_memory_bytes < block_bytes:  # was one block, past the budget
        raise ValueError(f"--kv-memory-mib {cache.kv_memory_bytes / (1 << 20):g} holds no KV block of "
                         f"{cache.block_size} tokens ({block_bytes / (1 << 20):.3g} MiB for this model): "
                         "raise it, or lower --block-size")
    return cache.num_blocks or cache.kv_memory_bytes // block_bytes


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * element_size


def _kv_cache_tensors(k_shape: tuple[int, ...], v_shape: tuple[int, ...], num_layers: int,
                      dtype: torch.dtype, device: str, huge_pages: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed (K, V) caches per layer; on CPU views of one slab, on huge pages where
    ``huge_pages`` (``host_memory``)."""
    if torch.device(device).type == "cpu":
        keep_freed_memory()  # the steps' activations are reused, not faulted in again (host_memory)
        tensors = zeroed_slab([k_shape, v_shape] * num_layers, dtype, huge_pages)
        return list(zip(tensors[0::2], tensors[1::2], strict=True))
    return [(torch.zeros(k_shape, dtype=dtype, device=device), torch.zeros(v_shape, dtype=dtype, device=device))
            for _ in range(num_layers)]


def make_runner(config: EngineConfig, model_config: ModelConfig, weights: dict[str, torch.Tensor],
                max_model_len: int, kv_huge_pages: bool = False) -> ModelRunner:
    """The runner ``config`` asks for: its dtype, KV cache dtype, device, attention backend, LoRA
    slots and (``kernels.cuda_graphs``, up to ``scheduler.max_num_seqs``) decode graphs; a CPU KV
    cache on huge pages where ``kv_huge_pages`` (NIXL registers it: ``host_memory``)."""
    dtype, kv_dtype, lora = DTYPES[config.dtype], DTYPES[config.kv_dtype], config.lora
    attention = make_attention_backend(config.attention_backend, dtype, config.device, config.kernels, kv_dtype)
    return ModelRunner(model_config, weights, config.cache, max_model_len, dtype=dtype, device=config.device,
                       attention=attention, kernels=config.kernels, kv_dtype=kv_dtype,
                       lora=LoraSlotShape(lora.max_loras, lora.max_lora_rank) if lora.enabled else None,
                       max_num_seqs=config.scheduler.max_num_seqs, kv_huge_pages=kv_huge_pages)


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        cache: CacheConfig,
        max_model_len: int,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        attention: AttentionBackend | None = None,
        kernels: KernelConfig | None = None,
        lora: LoraSlotShape | None = None,
        max_num_seqs: int = SchedulerConfig().max_num_seqs,
        kv_dtype: torch.dtype | None = None,
        kv_huge_pages: bool = False,
    ) -> None:
        """``kv_dtype``: the KV cache's dtype (None = ``dtype``); the attention backend computes in
        ``dtype`` and converts what it stores and reads. ``kv_huge_pages``: a CPU cache on
        transparent huge pages (for NIXL's reads; ``host_memory``)."""
        kv_dtype = kv_dtype or dtype
        self.device = device = resolve_device(device)
        self.use_device()  # this thread builds, warms up and captures on it
        weights = {name: w.to(dtype=dtype, device=device) for name, w in weights.items()}
        kernels = kernels or KernelConfig()
        self.config = config
        self.block_size = cache.block_size
        self.num_blocks = kv_pool_blocks(config, cache, kv_dtype)
        # No sequence outgrows the pool, so RoPE tables and graph block tables stop there: a config's
        # max_position_embeddings (2**40 in a hostile file) never sizes an allocation on its own.
        max_model_len = min(max_model_len, self.num_blocks * cache.block_size)
        self.model = LlamaModel(config, weights, max_positions=max_model_len, kernels=kernels, lora=lora)
        self.attention = attention or TorchReferenceBackend()
        # Why this run has no decode graphs ("" = it has them; see the module docstring).
        self.graphs_unavailable = graphs_unavailable_reason(kernels.cuda_graphs, device, self.attention)
        scratch = 0 if self.graphs_unavailable else 1  # the graphs' padding block, past the pool
        k_shape, v_shape = self.attention.kv_cache_shapes(
            self.num_blocks + scratch, cache.block_size, config.num_key_value_heads, config.head_dim)
        # The layout those shapes are in, named for the KV layout string engines compare (KvBlockIO).
        self.kv_layout_name = self.attention.kv_layout_name(config.head_dim, cache.block_size)
        check_kv_cache_fits((self.num_blocks + scratch) * kv_bytes_per_block(config, cache.block_size, kv_dtype),
                            self.num_blocks, device)
        full_caches = _kv_cache_tensors(k_shape, v_shape, config.num_hidden_layers, kv_dtype, device,
                                        kv_huge_pages)
        self.kv_caches = full_caches if not scratch else [(k[: self.num_blocks], v[: self.num_blocks])
                                                         for k, v in full_caches]
        self.graphs: DecodeGraphs | None = None
        if not self.graphs_unavailable:
            self.graphs = DecodeGraphs(self.model, self.attention, full_caches, device=device,
                                       max_num_seqs=max_num_seqs,
                                       max_num_blocks_per_seq=-(-max_model_len // cache.block_size),
                                       block_size=cache.block_size, scratch_block=self.num_blocks)

    def use_device(self) -> None:
        """Make the runner's GPU the calling thread's current CUDA device (a no-op on CPU). Triton
        launches on the current device and its stream, not on its tensors' device: on ``cuda:1``
        a thread still on GPU 0 would launch there. Each thread that runs the model calls it."""
        device = torch.device(self.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks before a step writes into them."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    def set_lora_slot(self, slot: int, layers: Sequence[Mapping[str, ProjectionDeltas]]) -> None:
        """Make ``slot`` hold one adapter: per layer, the deltas of the projections it targets
        (the others are cleared). Between steps only."""
        assert len(layers) == len(self.model.layers)
        with torch.inference_mode():
            for layer, deltas in zip(self.model.layers, layers, strict=True):
                for name, projection in layer.lora_projections().items():
                    projection.set_slot(slot, deltas.get(name))

    @torch.inference_mode()
    def execute(self, model_input: ModelInput, *, logits_on_device: bool = False) -> torch.Tensor | None:
        """Run one step: copy-on-write block copies, the forward pass (a decode graph's replay
        when the step is eligible), then the vocabulary projection of only
        ``model_input.logit_row_indices``. Returns those logits, ``[rows, vocab]`` float32 on
        the CPU (``logits_on_device``: left on the runner's device, for a sampler that runs
        there), or None when no row needs them."""
        self.copy_blocks(model_input.block_copies)
        if self.graphs is not None and not self.graphs.ineligible_reason(model_input):
            hidden = self.graphs.run(model_input)  # [padded batch, hidden]: the step's rows first
        else:
            hidden = self._forward(model_input)
        if model_input.logit_row_indices.numel() == 0:
            return None
        logits = self.model.compute_logits(hidden[model_input.logit_row_indices.to(self.device)])
        return logits if logits_on_device else logits.cpu()

    def _forward(self, model_input: ModelInput) -> torch.Tensor:
        """The eager forward pass: hidden states ``[num_tokens, hidden]``."""
        device = self.device
        meta = AttentionMetadata(
            query_start_loc=model_input.query_start_loc,
            seq_lens=model_input.seq_lens,
            block_tables=model_input.block_tables.to(device),
            slot_mapping=model_input.slot_mapping.to(device),
            block_size=self.block_size,
        )
        self.attention.prepare(meta)
        slots = model_input.adapter_slots
        ctx = ForwardContext(self.attention, self.kv_caches,
                             lora=None if slots is None else LoraBatch.build(slots.to(device)))
        embeds = model_input.input_embeds
        if embeds is not None:
            embeds = (embeds[0].to(device), embeds[1].to(device))
        return self.model.forward(model_input.input_ids.to(device), model_input.positions.to(device), ctx, embeds)
