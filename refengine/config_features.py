"""The configuration of the engine's optional features: guided decoding, KV events, KV
transfer (disaggregation), LoRA, media. Frozen dataclasses checked at construction, like
``config.py``'s (which re-exports them: import them from ``refengine.config``). No torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from refengine.config_checks import (
    LOOPBACK_SOURCES,
    UINT32_MAX,
    check_bool,
    check_choice,
    check_int,
    check_seconds,
    is_host,
    source_entry,
)

GUIDED_BACKENDS = ("xgrammar", "llguidance")


@dataclass(frozen=True)
class GuidedConfig:
    """Grammar-constrained sampling (``GenerateRequest.guided``).

    ``default_backend`` serves requests that name none. A grammar is compiled before the
    request is accepted, on one of ``compile_threads`` worker threads; a compile that takes
    longer than ``compile_timeout_seconds`` refuses the request (the worker finishes in the
    background, and its result is cached). ``cache_size`` compiled grammars are kept (LRU,
    keyed by backend, mode, spec and tokenizer), holding at most ``cache_bytes`` of token masks
    (xgrammar's; the newest entry is kept whatever its size). ``max_spec_bytes`` bounds the size of a
    schema, regex, grammar or structural tag; ``max_choices`` the entries of a choice list.
    ``max_token_seconds`` bounds one output's matching of one token (mask and acceptance, on
    the step thread): a guide that takes longer fails its request alone (``guided/budget.py``).
    """

    default_backend: str = "xgrammar"
    compile_timeout_seconds: float = 5.0
    compile_threads: int = 2
    cache_size: int = 256
    cache_bytes: int = 256 << 20
    max_spec_bytes: int = 64 * 1024
    max_choices: int = 1024
    max_token_seconds: float = 0.25

    def __post_init__(self) -> None:
        check_choice(self, "default_backend", GUIDED_BACKENDS)
        check_seconds(self, "compile_timeout_seconds")
        check_seconds(self, "max_token_seconds")
        check_int(self, "compile_threads", 1, 64)  # threads start up front: 100,000 failed the load (review)
        check_int(self, "cache_size", 1)
        check_int(self, "cache_bytes", 0)
        check_int(self, "max_spec_bytes", 1)
        check_int(self, "max_choices", 1)


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
        check_bool(self, "enabled")
        check_int(self, "retained_batches", 1, UINT32_MAX)
        check_int(self, "subscriber_buffer", 1, UINT32_MAX)


ENGINE_ROLES = ("aggregated", "prefill", "decode", "encoder")
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
    ``num_transfer_threads``: pulls a decode engine runs at once, at most one less of them from one
    source (``kv/transfer/source_pool.py``: a hung source leaves pulls from the others a thread).
    ``pull_timeout_seconds``:
    the longest one pull may take before it fails (KV_TRANSFER_FAILED). ``allowed_sources``:
    the servers a KV session's or an embedding handle's endpoint may name (host names, IP
    addresses or CIDR networks, ``loopback``, ``any``): pulled rows enter the prefix cache under
    the request's prompt, so a source a client made up could put made-up KV there for every
    later client (``engine/kv_sources.py``). Loopback only by default.
    """

    backend: str = "grpc"
    session_ttl_seconds: float = 30.0
    chunk_bytes: int = 4 << 20
    num_transfer_threads: int = 4
    pull_timeout_seconds: float = 30.0
    allowed_sources: tuple[str, ...] = (LOOPBACK_SOURCES,)

    def __post_init__(self) -> None:
        check_choice(self, "backend", TRANSFER_BACKENDS)
        check_seconds(self, "session_ttl_seconds")
        check_int(self, "chunk_bytes", 1 << 12, 1 << 26)
        check_int(self, "num_transfer_threads", 1, 64)
        check_seconds(self, "pull_timeout_seconds")
        if not self.allowed_sources or not isinstance(self.allowed_sources, tuple):
            raise ValueError("KvTransferConfig.allowed_sources must be a non-empty tuple (loopback: this host only)")
        for entry in self.allowed_sources:
            try:
                source_entry(entry)
            except ValueError as exc:
                raise ValueError(f"KvTransferConfig.allowed_sources: {exc}") from None


@dataclass(frozen=True)
class LoraConfig:
    """Multi-LoRA (PEFT adapters loaded at run time through ``LoadLora``).

    ``enabled``: the LoRA RPCs and ``lora_name`` work (R5, R6); off, they answer
    FAILED_PRECONDITION / NOT_FOUND. ``roots``: absolute directories an adapter's
    ``source_path`` must resolve inside (after following symlinks); no root, no adapter.
    Enabled needs a root. ``max_loras``: adapter slots on the device (``DeploymentCapacity.max_loras``): the
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
        check_bool(self, "enabled")
        if not isinstance(self.roots, tuple) or not all(isinstance(r, str) and os.path.isabs(r) for r in self.roots):
            raise ValueError(f"LoraConfig.roots must be a tuple of absolute directories, got {self.roots!r}")
        if self.enabled and not self.roots:  # every LoadLora would fail: supports_lora would not mean it (R6)
            raise ValueError("LoraConfig.enabled needs LoraConfig.roots: without a root no adapter can be loaded")
        check_int(self, "max_loras", 1, 256)
        check_int(self, "max_lora_rank", 1, 512)
        check_int(self, "max_loaded_loras", 1)
        if self.max_loaded_loras < self.max_loras:
            raise ValueError(f"LoraConfig.max_loaded_loras ({self.max_loaded_loras}) must be >= max_loras "
                             f"({self.max_loras})")


@dataclass(frozen=True)
class MediaConfig:
    """Limits on ``GenerateRequest.media`` (multimodal models only).

    ``max_items``: media items per request. ``max_bytes``: encoded bytes of one item (a
    data URI's decoded payload, raw bytes, or a fetched body). ``max_pixels``: width x
    height of one decoded image (also Pillow's decompression-bomb limit: a larger header
    is refused before decoding). ``max_aspect_ratio``: the long side over the short side of one
    image: a vision model's preprocessing scales the short side up to its input size, so a
    tiny 80,000 x 1 image (318 bytes of PNG) became 4.5 M pixels of float32 per channel and
    took 2.5 GB; above this ratio an image is refused before decoding. ``image_formats``: the
    Pillow formats accepted.
    ``url_allow_hosts``: hosts ``url`` sources may be fetched from (http and https only);
    empty = URL fetching off. ``url_allow_private``: also allow hosts that resolve to
    loopback, private, link-local or otherwise non-global addresses (an SSRF surface: off by
    default). ``url_timeout_seconds``: the whole fetch, redirects included.
    ``url_max_redirects``: redirects followed, each re-checked against the policy.
    ``encoder_cache_bytes``: memory for encoded images kept for reuse (the engine's encoder
    cache, ``multimodal/encoder_cache.py``), on the model's device and outside the KV pool's
    budget; 0 = encode every item afresh.
    """

    max_items: int = 8
    max_bytes: int = 20 << 20
    max_pixels: int = 16_000_000
    max_aspect_ratio: int = 100
    image_formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
    url_allow_hosts: tuple[str, ...] = ()
    url_allow_private: bool = False
    url_timeout_seconds: float = 10.0
    url_max_redirects: int = 3
    encoder_cache_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        check_int(self, "max_items", 1, 256)
        check_int(self, "max_bytes", 1)
        check_int(self, "max_pixels", 1)
        check_int(self, "max_aspect_ratio", 1)
        for name in ("image_formats", "url_allow_hosts"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"MediaConfig.{name} must be a tuple of non-empty strings, got {value!r}")
        for host in self.url_allow_hosts:  # a URL here never matched a request's host (found by review)
            if not is_host(host):
                raise ValueError(f"MediaConfig.url_allow_hosts entries must be host names or IP addresses (no "
                                 f"scheme, port or path), got {host!r}")
        check_bool(self, "url_allow_private")
        check_seconds(self, "url_timeout_seconds")
        check_int(self, "url_max_redirects", 0, 20)
        check_int(self, "encoder_cache_bytes", 0)


@dataclass(frozen=True)
class EncoderConfig:
    """Embedding handles (draft profile ``encoder``, docs/profiles/encoder.md).

    Encoder role: ``memory_mib`` of host memory hold the embeddings of live handles and of
    the encoder cache; ``max_cached_entries`` items no handle holds are kept for reuse (least
    recently used evicted first, or whenever a new item needs their rows); a handle's lease is
    ``lease_seconds`` unless Encode asks otherwise, at most ``max_lease_seconds``.
    Consumers (aggregated and prefill roles): handles are pulled into ``staging_mib`` of host
    memory by ``pull_threads`` threads (at most one less of them from one encoder), over
    ``pull_timeout_seconds`` at most.
    """

    memory_mib: int = 256
    max_cached_entries: int = 256
    lease_seconds: float = 60.0
    max_lease_seconds: float = 600.0
    staging_mib: int = 64
    pull_threads: int = 2
    pull_timeout_seconds: float = 30.0

    def __post_init__(self) -> None:
        check_int(self, "memory_mib", 1)
        check_int(self, "max_cached_entries", 0)
        check_seconds(self, "lease_seconds")
        check_seconds(self, "max_lease_seconds")
        if self.lease_seconds > self.max_lease_seconds:
            raise ValueError(f"EncoderConfig.lease_seconds ({self.lease_seconds}) must be <= max_lease_seconds "
                             f"({self.max_lease_seconds})")
        check_int(self, "staging_mib", 1)
        check_int(self, "pull_threads", 1, 64)
        check_seconds(self, "pull_timeout_seconds")
