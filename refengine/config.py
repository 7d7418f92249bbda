"""All engine configuration as frozen dataclasses: here, and the optional features' in
``config_features.py`` (re-exported here, so everything imports from ``refengine.config``).

Every default is documented here and surfaced by ``refengine serve --help``
(``refengine/args.py`` holds the flags). Each dataclass checks its own fields in
``__post_init__``, so a bad value fails where it is made, with a message naming the
field and the allowed range, never deep inside the engine.

This module must not import torch: the gRPC server imports it, and the server never
touches tensors (a test checks both this module and ``refengine.args``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from refengine.config_checks import (
    UINT32_MAX,
    check_bool,
    check_choice,
    check_int,
    check_name,
    check_positive_float,
    is_int,
)
from refengine.config_features import (
    ENGINE_ROLES,
    GUIDED_BACKENDS,
    TRANSFER_BACKENDS,
    EncoderConfig,
    GuidedConfig,
    KvEventsConfig,
    KvTransferConfig,
    LoraConfig,
    MediaConfig,
)

__all__ = ["ENGINE_ROLES", "GUIDED_BACKENDS", "TRANSFER_BACKENDS", "CacheConfig", "EncoderConfig", "EngineConfig",
           "GuidedConfig",
           "KernelConfig", "KvEventsConfig", "KvTransferConfig", "LoraConfig", "MediaConfig", "ModelConfig",
           "SchedulerConfig", "default_cache_dir"]

# Names the runner maps to torch dtypes (``refengine.model.runner.DTYPES``).
DTYPE_NAMES = ("float32", "float16", "bfloat16")
DEVICE_NAME = re.compile(r"cpu|cuda(:[0-9]+)?")  # the devices the engine runs on
MAX_THREADS = 4096  # --num-threads beyond it is a typo (torch refuses values past a C int with a traceback)
# "auto" plus the registered backends, in preference order. The registry in
# ``refengine.kernels.attention`` defines the backends; this copy exists because this
# module may not import torch, and ``tests/unit/test_config.py`` checks the two agree.
ATTENTION_BACKENDS = ("auto", "flashinfer", "triton", "cpu", "torch")
UINT64_MAX = (1 << 64) - 1


def default_cache_dir() -> Path:
    """refengine's cache root: ``$REFENGINE_CACHE_DIR``, else ``$XDG_CACHE_HOME/refengine``
    (``~/.cache/refengine``). Converted models live in ``<root>/models/<name>``, built
    native kernels in ``<root>/kernels/<key>``."""
    if env := os.environ.get("REFENGINE_CACHE_DIR"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "refengine"


# ----------------------------------------------------------------------------- configs


#: What llama3 (Llama 3.1) RoPE scaling reads; transformers' _validate_llama3_rope_parameters requires each.
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder, as read from ``config.json``.

    ``rope_scaling`` holds the Hugging Face dict (``rope_type`` = ``llama3`` is the
    only non-default kind we implement, with every key of ``LLAMA3_ROPE_KEYS``: transformers
    refuses a config without one, so no default is guessed); ``None`` means plain RoPE.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has bias on q/k/v only
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_name(self, "architecture")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            check_int(self, name, 1)
        # Grouped-query attention: query head h reads KV head h // (heads / kv_heads).
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"ModelConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:  # rotate-half RoPE pairs the two halves of a head
            raise ValueError(f"ModelConfig.head_dim must be even, got {self.head_dim}")
        check_positive_float(self, "rms_norm_eps")
        check_positive_float(self, "rope_theta")
        self._check_rope_scaling()
        check_int(self, "bos_token_id", 0, self.vocab_size - 1, optional=True)
        if any(not is_int(t) or not 0 <= t < self.vocab_size for t in self.eos_token_ids):
            raise ValueError(f"ModelConfig.eos_token_ids must be integers in [0, vocab_size={self.vocab_size}), "
                             f"got {self.eos_token_ids!r}")

    def _check_rope_scaling(self) -> None:
        if self.rope_scaling is None:
            return
        rope_type = self.rope_scaling.get("rope_type")
        if rope_type != "llama3":
            raise ValueError(f"ModelConfig.rope_scaling: RoPE scaling {rope_type!r} is not implemented (only 'llama3')")
        if missing := [key for key in LLAMA3_ROPE_KEYS if key not in self.rope_scaling]:
            raise ValueError(f"ModelConfig.rope_scaling: llama3 RoPE scaling needs {', '.join(missing)} "
                             "(transformers refuses it without them too)")
        if any(isinstance(self.rope_scaling[key], bool) or not isinstance(self.rope_scaling[key], (int, float))
               or self.rope_scaling[key] <= 0 for key in LLAMA3_ROPE_KEYS):
            raise ValueError("ModelConfig.rope_scaling: llama3 RoPE scaling's "
                             f"{', '.join(LLAMA3_ROPE_KEYS)} must be positive numbers, got "
                             f"{ {key: self.rope_scaling[key] for key in LLAMA3_ROPE_KEYS} }")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing.

    ``num_blocks`` wins when set; otherwise the pool is sized so that the KV tensors
    fit in ``kv_memory_bytes``.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_memory_bytes: int = 1 << 30
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        check_int(self, "block_size", 1, UINT32_MAX)  # KV events carry it as uint32
        check_int(self, "num_blocks", 1, optional=True)
        check_int(self, "kv_memory_bytes", 1)
        check_bool(self, "enable_prefix_caching")
        # A pool under 2 tokens cannot hold a prompt token and one generated: every request would be
        # refused by a server that reports READY (found by review: --num-kv-blocks 1 --block-size 1).
        if self.num_blocks is not None and self.num_blocks * self.block_size < 2:
            raise ValueError(f"CacheConfig.num_blocks x block_size is {self.num_blocks * self.block_size} tokens; a "
                             "request needs at least 2 (a prompt token and one generated)")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits.

    ``max_num_batched_tokens`` is the per-step token budget shared by prefill chunks
    and decodes; ``max_num_seqs`` caps the running set (each of a request's
    ``num_sequences`` outputs counts as one); ``max_active_requests`` caps every
    accepted, unfinished request (waiting or running); one more is refused as
    overloaded. A budget below ``max_num_seqs`` lets the running sequences first in order
    take every token while the others wait (``refengine serve`` refuses it); tests use tiny
    budgets to chunk prompts.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_active_requests: int = 4096

    def __post_init__(self) -> None:
        check_int(self, "max_num_batched_tokens", 1, UINT32_MAX)
        check_int(self, "max_num_seqs", 1, UINT32_MAX)
        check_int(self, "max_active_requests", 1, UINT32_MAX)


@dataclass(frozen=True)
class KernelConfig:
    """Which native fast paths may be used; each has a torch fallback that defines
    its semantics, so turning one off changes speed, not meaning.

    ``native_cpu_kernels``: build (with the machine's C compiler, on first use) and use
    the C kernels in ``refengine/kernels/cpu`` (paged attention, fused elementwise ops).
    ``onednn_linear``: run float32 CPU projections on weights prepacked for oneDNN.
    ``cuda_graphs``: on CUDA, with an attention backend that supports capture, replay decode
    steps from CUDA graphs captured per padded batch size (``refengine/model/cuda_graphs.py``);
    no effect on CPU.
    ``device_sampling``: on a GPU, sample where the logits are (the ``[rows, vocab]`` logits
    never cross to the host; the sampler's per-row uniforms go over and the chosen ids come
    back); off, the logits are copied to the CPU each step and sampled there. No effect on CPU.
    """

    native_cpu_kernels: bool = True
    onednn_linear: bool = True
    cuda_graphs: bool = True
    device_sampling: bool = True

    def __post_init__(self) -> None:
        check_bool(self, "native_cpu_kernels")
        check_bool(self, "onednn_linear")
        check_bool(self, "cuda_graphs")
        check_bool(self, "device_sampling")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the weights.

    ``model`` is a manifest name (``smollm2-135m-instruct``) or a path to a Hugging
    Face directory or a GGUF file. ``max_model_len`` ``None`` = the model's own limit.
    """

    model: str = "smollm2-135m-instruct"
    served_model_name: str | None = None  # None = the manifest name (or the path's name)
    # Further names Generate and GetModelInfo accept (D8: ModelInfo.served_model_aliases), e.g. the
    # directory name a framework uses for the model.
    served_model_aliases: tuple[str, ...] = ()
    dtype: str = "float32"
    # The KV cache's dtype; "auto" = ``dtype``. A 16-bit cache under float32 weights halves the
    # bytes per block (twice the blocks in the same --kv-memory-mib, half the KV read per decode
    # step); attention computes in ``dtype`` and rounds the step's own keys and values to the
    # cache dtype before using them, so a prompt's result does not depend on its chunking.
    kv_cache_dtype: str = "auto"
    device: str = "cpu"
    max_model_len: int | None = None  # >= 2: room for a prompt token and one generated token
    # Most outputs one request may ask for (SamplingParams.num_sequences). A request's outputs all
    # run at once, so this may not exceed scheduler.max_num_seqs.
    max_sequences_per_request: int = 16
    max_logprobs: int = 20  # largest top-N candidate count
    seed: int = 0  # seeds the sampler's shared generator (requests without their own seed)
    num_threads: int | None = None  # torch intra-op threads; None = torch's default (all cores)
    # "auto": the first available backend in ATTENTION_BACKENDS order (FlashInfer on CUDA when it is
    # installed and the dtype is fp16/bf16, else the Triton kernels on CUDA; the native paged kernel
    # for float32 on CPU when it builds, else the torch reference); a name: that backend or an error.
    attention_backend: str = "auto"
    # Run the KV pool's integrity check (free + cached + referenced = all blocks) each time the
    # engine becomes idle; costs a pass over the pool, so off by default.
    debug_kv_integrity: bool = False
    # aggregated: prompt and output here. prefill: compute the prompt's KV and first token, then
    # hand them over as a KV session (PrefillReady). decode: continue a session prefilled elsewhere.
    role: str = "aggregated"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    guided: GuidedConfig = field(default_factory=GuidedConfig)
    kv_events: KvEventsConfig = field(default_factory=KvEventsConfig)
    kv_transfer: KvTransferConfig = field(default_factory=KvTransferConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    media: MediaConfig = field(default_factory=MediaConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)

    def __post_init__(self) -> None:
        check_name(self, "model")
        check_name(self, "served_model_name", optional=True)
        self.check_aliases()
        check_choice(self, "dtype", DTYPE_NAMES)
        check_choice(self, "kv_cache_dtype", ("auto", *DTYPE_NAMES))
        check_name(self, "device")
        if not DEVICE_NAME.fullmatch(self.device):  # found by review: "gpu" failed later with a traceback
            raise ValueError(f"EngineConfig.device must be cpu, cuda or cuda:N, got {self.device!r}")
        check_int(self, "max_model_len", 2, optional=True)
        check_int(self, "max_sequences_per_request", 1, UINT32_MAX)
        check_int(self, "max_logprobs", 0, UINT32_MAX)
        check_int(self, "seed", 0, UINT64_MAX)
        check_int(self, "num_threads", 1, MAX_THREADS, optional=True)
        check_choice(self, "attention_backend", ATTENTION_BACKENDS)
        check_bool(self, "debug_kv_integrity")
        check_choice(self, "role", ENGINE_ROLES)
        self.check_parts()

    @property
    def kv_dtype(self) -> str:
        """The KV cache's dtype name: ``kv_cache_dtype``, "auto" resolved to ``dtype``."""
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def check_aliases(self) -> None:
        aliases = self.served_model_aliases
        if not isinstance(aliases, tuple):  # a list would make the frozen config unhashable
            raise ValueError(f"EngineConfig.served_model_aliases must be a tuple of names, got {aliases!r}")
        if any(not isinstance(alias, str) or not alias or alias != alias.strip() for alias in aliases):
            raise ValueError(f"EngineConfig.served_model_aliases: an alias must be a non-empty name without white "
                             f"space around it, got {list(aliases)}")
        if len(set(aliases)) != len(aliases):
            raise ValueError(f"EngineConfig.served_model_aliases lists a name twice: {list(aliases)}")
        if self.served_model_name is not None and self.served_model_name in aliases:
            raise ValueError("EngineConfig.served_model_aliases repeats the served model name "
                             f"{self.served_model_name!r}")

    def check_parts(self) -> None:
        for name, kind in (("cache", CacheConfig), ("scheduler", SchedulerConfig), ("kernels", KernelConfig),
                           ("guided", GuidedConfig), ("kv_events", KvEventsConfig),
                           ("kv_transfer", KvTransferConfig), ("lora", LoraConfig), ("media", MediaConfig),
                           ("encoder", EncoderConfig)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"EngineConfig.{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        # Known from the flags alone: a CUDA backend on cpu failed after the listeners were up (review).
        runs_on = {"flashinfer": "cuda", "triton": "cuda", "cpu": "cpu"}.get(self.attention_backend)
        if runs_on is not None and (runs_on == "cpu") != (self.device == "cpu"):
            raise ValueError(f"EngineConfig.attention_backend {self.attention_backend} runs on {runs_on}, not on "
                             f"{self.device} (auto picks what the device runs)")
        limit = self.scheduler.max_num_seqs
        if self.max_sequences_per_request > limit:
            raise ValueError(
                f"EngineConfig.max_sequences_per_request ({self.max_sequences_per_request}) must be <= "
                f"SchedulerConfig.max_num_seqs ({limit}): a request's outputs all run at once")
