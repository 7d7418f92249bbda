"""All engine configuration, in one place, as frozen dataclasses.

Every default is documented here and surfaced by ``refengine serve --help``
(``refengine/args.py`` holds the flags). Each dataclass checks its own fields in
``__post_init__``, so a bad value fails where it is made, with a message naming the
field and the allowed range, never deep inside the engine.

This module must not import torch: the gRPC server imports it, and the server never
touches tensors (a test checks both this module and ``refengine.args``).
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path

# Names the runner maps to torch dtypes (``refengine.model.runner.DTYPES``).
DTYPE_NAMES = ("float32", "float16", "bfloat16")
# "auto" plus the registered backends, in preference order. The registry in
# ``refengine.kernels.attention`` defines the backends; this copy exists because this
# module may not import torch, and ``tests/unit/test_config.py`` checks the two agree.
ATTENTION_BACKENDS = ("auto", "cpu", "torch")
UINT64_MAX = (1 << 64) - 1


def default_cache_dir() -> Path:
    """refengine's cache root: ``$REFENGINE_CACHE_DIR``, else ``$XDG_CACHE_HOME/refengine``
    (``~/.cache/refengine``). Converted models live in ``<root>/models/<name>``, built
    native kernels in ``<root>/kernels/<key>``."""
    if env := os.environ.get("REFENGINE_CACHE_DIR"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "refengine"


# ----------------------------------------------------------------------------- checks


def _check_int(owner: object, name: str, minimum: int, maximum: int | None = None, optional: bool = False) -> None:
    """``owner.name`` is an int in ``[minimum, maximum]`` (or ``None`` when ``optional``)."""
    value = getattr(owner, name)
    if optional and value is None:
        return
    if not (_is_int(value) and value >= minimum and (maximum is None or value <= maximum)):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        none = " or None" if optional else ""
        raise ValueError(f"{type(owner).__name__}.{name} must be an integer {bound}{none}, got {value!r}")


def _is_int(value: object) -> bool:
    # Integral admits numpy integers (from parsed model files); True is an int to Python, not to us.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_positive_float(owner: object, name: str) -> None:
    value = getattr(owner, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"{type(owner).__name__}.{name} must be a number > 0, got {value!r}")


def _check_bool(owner: object, name: str) -> None:
    value = getattr(owner, name)
    if not isinstance(value, bool):
        raise ValueError(f"{type(owner).__name__}.{name} must be True or False, got {value!r}")


def _check_choice(owner: object, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(owner, name)
    if value not in choices:
        raise ValueError(f"{type(owner).__name__}.{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_name(owner: object, name: str, optional: bool = False) -> None:
    value = getattr(owner, name)
    if optional and value is None:
        return
    if not isinstance(value, str) or not value:
        none = " or None" if optional else ""
        raise ValueError(f"{type(owner).__name__}.{name} must be a non-empty string{none}, got {value!r}")


# ----------------------------------------------------------------------------- configs


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

    def __post_init__(self) -> None:
        _check_name(self, "architecture")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            _check_int(self, name, 1)
        # Grouped-query attention: query head h reads KV head h // (heads / kv_heads).
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"ModelConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:  # rotate-half RoPE pairs the two halves of a head
            raise ValueError(f"ModelConfig.head_dim must be even, got {self.head_dim}")
        _check_positive_float(self, "rms_norm_eps")
        _check_positive_float(self, "rope_theta")
        _check_int(self, "bos_token_id", 0, optional=True)
        if any(not _is_int(t) or t < 0 for t in self.eos_token_ids):
            raise ValueError(f"ModelConfig.eos_token_ids must be integers >= 0, got {self.eos_token_ids!r}")


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
        _check_int(self, "block_size", 1)
        _check_int(self, "num_blocks", 1, optional=True)
        _check_int(self, "kv_memory_bytes", 1)
        _check_bool(self, "enable_prefix_caching")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits.

    ``max_num_batched_tokens`` is the per-step token budget shared by prefill chunks
    and decodes; ``max_num_seqs`` caps the running set (each of a request's
    ``num_sequences`` outputs counts as one); ``max_active_requests`` caps every
    accepted, unfinished request (waiting or running); one more is refused as
    overloaded.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_active_requests: int = 4096

    def __post_init__(self) -> None:
        _check_int(self, "max_num_batched_tokens", 1)
        _check_int(self, "max_num_seqs", 1)
        _check_int(self, "max_active_requests", 1)


@dataclass(frozen=True)
class KernelConfig:
    """Which native fast paths may be used; each has a torch fallback that defines
    its semantics, so turning one off changes speed, not meaning.

    ``native_cpu_kernels``: build (with the machine's C compiler, on first use) and use
    the C kernels in ``refengine/kernels/cpu`` (paged attention, fused elementwise ops).
    ``onednn_linear``: run float32 CPU projections on weights prepacked for oneDNN.
    """

    native_cpu_kernels: bool = True
    onednn_linear: bool = True

    def __post_init__(self) -> None:
        _check_bool(self, "native_cpu_kernels")
        _check_bool(self, "onednn_linear")


GUIDED_BACKENDS = ("xgrammar", "llguidance")


@dataclass(frozen=True)
class GuidedConfig:
    """Grammar-constrained sampling (``GenerateRequest.guided``).

    ``default_backend`` serves requests that name none. A grammar is compiled before the
    request is accepted, on one of ``compile_threads`` worker threads; a compile that takes
    longer than ``compile_timeout_seconds`` refuses the request (the worker finishes in the
    background, and its result is cached). ``cache_size`` compiled grammars are kept (LRU,
    keyed by backend, mode, spec and tokenizer). ``max_spec_bytes`` bounds the size of a
    schema, regex, grammar or structural tag; ``max_choices`` the entries of a choice list.
    """

    default_backend: str = "xgrammar"
    compile_timeout_seconds: float = 5.0
    compile_threads: int = 2
    cache_size: int = 256
    max_spec_bytes: int = 64 * 1024
    max_choices: int = 1024

    def __post_init__(self) -> None:
        _check_choice(self, "default_backend", GUIDED_BACKENDS)
        _check_positive_float(self, "compile_timeout_seconds")
        _check_int(self, "compile_threads", 1)
        _check_int(self, "cache_size", 1)
        _check_int(self, "max_spec_bytes", 1)
        _check_int(self, "max_choices", 1)


@dataclass(frozen=True)
class KvEventsConfig:
    """KV events for KV-aware routers (``SubscribeKvEvents``, and the ZMQ source of the server).

    ``enabled``: the prefix cache records its changes and each step's are published as one
    numbered batch. ``retained_batches``: the newest batches kept for replay
    (``start_sequence_number``). ``subscriber_buffer``: batches one subscriber may hold
    unread; a subscriber past it is cut off with an error, never slowing the engine.
    """

    enabled: bool = True
    retained_batches: int = 10_000
    subscriber_buffer: int = 1024

    def __post_init__(self) -> None:
        _check_bool(self, "enabled")
        _check_int(self, "retained_batches", 1)
        _check_int(self, "subscriber_buffer", 1)


ENGINE_ROLES = ("aggregated", "prefill", "decode")
TRANSFER_BACKENDS = ("grpc", "nixl")


@dataclass(frozen=True)
class KvTransferConfig:
    """Disaggregated prefill/decode (``role`` prefill or decode).

    ``backend``: how this engine's KV sessions are offered when it prefills — ``grpc`` (the
    decode engine pulls over refengine's own ``refengine.kvpull.v1`` service on this
    server's port; always available) or ``nixl`` (the decode engine READs the blocks
    with NIXL; needs the ``nixl`` package). A decode engine accepts every backend it has.
    ``session_ttl_seconds``: the lease of a session not yet pulled; its KV is freed at
    expiry. ``chunk_bytes``: the most KV bytes in one gRPC pull chunk (each checksummed).
    ``num_transfer_threads``: pulls a decode engine runs at once. ``pull_timeout_seconds``:
    the longest one pull may take before it fails (KV_TRANSFER_FAILED).
    """

    backend: str = "grpc"
    session_ttl_seconds: float = 30.0
    chunk_bytes: int = 4 << 20
    num_transfer_threads: int = 4
    pull_timeout_seconds: float = 30.0

    def __post_init__(self) -> None:
        _check_choice(self, "backend", TRANSFER_BACKENDS)
        _check_positive_float(self, "session_ttl_seconds")
        _check_int(self, "chunk_bytes", 1 << 12, 1 << 26)
        _check_int(self, "num_transfer_threads", 1, 64)
        _check_positive_float(self, "pull_timeout_seconds")


@dataclass(frozen=True)
class LoraConfig:
    """Multi-LoRA (PEFT adapters loaded at run time through ``LoadLora``).

    ``enabled``: the LoRA RPCs and ``lora_name`` work (R5, R6); off, they answer
    FAILED_PRECONDITION / NOT_FOUND. ``roots``: absolute directories an adapter's
    ``source_path`` must resolve inside (after following symlinks); no root, no adapter.
    ``max_loras``: adapter slots on the device (``DeploymentCapacity.max_loras``): the
    most distinct adapters the running requests may use at once. ``max_lora_rank``: the
    largest rank an adapter may have (slot memory is sized by it). ``max_loaded_loras``:
    the most adapters registered at once (kept in host memory, swapped into slots).
    """

    enabled: bool = False
    roots: tuple[str, ...] = ()
    max_loras: int = 4
    max_lora_rank: int = 16
    max_loaded_loras: int = 64

    def __post_init__(self) -> None:
        _check_bool(self, "enabled")
        if not isinstance(self.roots, tuple) or not all(isinstance(r, str) and os.path.isabs(r) for r in self.roots):
            raise ValueError(f"LoraConfig.roots must be a tuple of absolute directories, got {self.roots!r}")
        _check_int(self, "max_loras", 1, 256)
        _check_int(self, "max_lora_rank", 1, 512)
        _check_int(self, "max_loaded_loras", 1)
        if self.max_loaded_loras < self.max_loras:
            raise ValueError(f"LoraConfig.max_loaded_loras ({self.max_loaded_loras}) must be >= max_loras "
                             f"({self.max_loras})")


@dataclass(frozen=True)
class MediaConfig:
    """Limits on ``GenerateRequest.media`` (multimodal models only).

    ``max_items``: media items per request. ``max_bytes``: encoded bytes of one item (a
    data URI's decoded payload, raw bytes, or a fetched body). ``max_pixels``: width x
    height of one decoded image (also Pillow's decompression-bomb limit: a larger header
    is refused before decoding). ``image_formats``: the Pillow formats accepted.
    ``url_allow_hosts``: hosts ``url`` sources may be fetched from (http and https only);
    empty = URL fetching off. ``url_allow_private``: also allow hosts that resolve to
    loopback, private, link-local or otherwise non-global addresses (an SSRF surface: off by
    default). ``url_timeout_seconds``: the whole fetch, redirects included.
    ``url_max_redirects``: redirects followed, each re-checked against the policy.
    """

    max_items: int = 8
    max_bytes: int = 20 << 20
    max_pixels: int = 16_000_000
    image_formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
    url_allow_hosts: tuple[str, ...] = ()
    url_allow_private: bool = False
    url_timeout_seconds: float = 10.0
    url_max_redirects: int = 3

    def __post_init__(self) -> None:
        _check_int(self, "max_items", 1, 256)
        _check_int(self, "max_bytes", 1)
        _check_int(self, "max_pixels", 1)
        for name in ("image_formats", "url_allow_hosts"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"MediaConfig.{name} must be a tuple of non-empty strings, got {value!r}")
        _check_bool(self, "url_allow_private")
        _check_positive_float(self, "url_timeout_seconds")
        _check_int(self, "url_max_redirects", 0, 20)


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
    max_model_len: int | None = None  # >= 2: room for a prompt token and one generated token
    # Most outputs one request may ask for (SamplingParams.num_sequences). A request's outputs all
    # run at once, so this may not exceed scheduler.max_num_seqs.
    max_sequences_per_request: int = 16
    max_logprobs: int = 20  # largest top-N candidate count
    seed: int = 0  # seeds the sampler's shared generator (requests without their own seed)
    num_threads: int | None = None  # torch intra-op threads; None = torch's default (all cores)
    # "auto": the first available backend in ATTENTION_BACKENDS order (the native paged kernel
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

    def __post_init__(self) -> None:
        _check_name(self, "model")
        _check_name(self, "served_model_name", optional=True)
        self._check_aliases()
        _check_choice(self, "dtype", DTYPE_NAMES)
        _check_name(self, "device")
        _check_int(self, "max_model_len", 2, optional=True)
        _check_int(self, "max_sequences_per_request", 1)
        _check_int(self, "max_logprobs", 0)
        _check_int(self, "seed", 0, UINT64_MAX)
        _check_int(self, "num_threads", 1, optional=True)
        _check_choice(self, "attention_backend", ATTENTION_BACKENDS)
        _check_bool(self, "debug_kv_integrity")
        _check_choice(self, "role", ENGINE_ROLES)
        self._check_parts()

    def _check_aliases(self) -> None:
        aliases = self.served_model_aliases
        if not isinstance(aliases, tuple):  # a list would make the frozen config unhashable
            raise ValueError(f"served_model_aliases must be a tuple of names, got {aliases!r}")
        if any(not alias for alias in aliases):
            raise ValueError("served_model_aliases: an alias must be a non-empty name")
        if len(set(aliases)) != len(aliases):
            raise ValueError(f"served_model_aliases lists a name twice: {list(aliases)}")
        if self.served_model_name is not None and self.served_model_name in aliases:
            raise ValueError(f"served_model_aliases repeats the served model name {self.served_model_name!r}")

    def _check_parts(self) -> None:
        for name, kind in (("cache", CacheConfig), ("scheduler", SchedulerConfig), ("kernels", KernelConfig),
                           ("guided", GuidedConfig), ("kv_events", KvEventsConfig),
                           ("kv_transfer", KvTransferConfig), ("lora", LoraConfig), ("media", MediaConfig)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"EngineConfig.{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        limit = self.scheduler.max_num_seqs
        if self.max_sequences_per_request > limit:
            raise ValueError(
                f"EngineConfig.max_sequences_per_request ({self.max_sequences_per_request}) must be <= "
                f"SchedulerConfig.max_num_seqs ({limit}): a request's outputs all run at once")
