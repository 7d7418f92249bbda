"""All engine configuration, in one place, as frozen dataclasses.

Every default is documented here and surfaced by ``refengine serve --help``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


def default_cache_dir() -> Path:
    """refengine's cache root: ``$REFENGINE_CACHE_DIR``, else ``$XDG_CACHE_HOME/refengine``
    (``~/.cache/refengine``). Converted models live in ``<root>/models/<name>``, built
    native kernels in ``<root>/kernels/<key>``."""
    if env := os.environ.get("REFENGINE_CACHE_DIR"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "refengine"


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder, as read from ``config.json``.

    ``rope_scaling`` holds the Hugging Face dict (``rope_type`` = ``llama3`` is the
    only non-default kind we implement); ``None`` means plain RoPE.
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


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits.

    ``max_num_batched_tokens`` is the per-step token budget shared by prefill chunks
    and decodes; ``max_num_seqs`` caps the running set (each of a request's
    ``num_sequences`` outputs counts as one).
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_waiting_requests: int = 4096


ATTENTION_BACKENDS = ("auto", "cpu", "torch")


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
    device: str = "cpu"
    max_model_len: int | None = None
    max_num_sequences: int = 16  # most outputs one request may ask for (num_sequences)
    max_logprobs: int = 20  # largest top-N candidate count
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads; None = torch's default (all cores)
    # "auto": the native paged kernel for float32 on CPU when it builds, else the torch
    # reference; "cpu": the native kernel or an error; "torch": the reference.
    attention_backend: str = "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        aliases = self.served_model_aliases
        if any(not alias for alias in aliases):
            raise ValueError("served_model_aliases: an alias must be a non-empty name")
        if len(set(aliases)) != len(aliases):
            raise ValueError(f"served_model_aliases lists a name twice: {list(aliases)}")
        if self.served_model_name is not None and self.served_model_name in aliases:
            raise ValueError(f"served_model_aliases repeats the served model name {self.served_model_name!r}")
