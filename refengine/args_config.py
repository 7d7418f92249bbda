"""From parsed command-line flags to an ``EngineConfig`` (the flags themselves: ``refengine.args``).

A value a config dataclass refuses is reported naming the flag that set it (``FIELD_FLAGS``).
No torch here: the server builds its config from these flags.
"""

from __future__ import annotations

import argparse
import math
import os

from refengine.config import (
    CacheConfig,
    EncoderConfig,
    EngineConfig,
    GuidedConfig,
    KernelConfig,
    KvEventsConfig,
    KvTransferConfig,
    LoraConfig,
    MediaConfig,
    SchedulerConfig,
)

MIB_SHIFT = 20

# Which flag sets which field, for error messages and for the test that every field has one.
FIELD_FLAGS = {
    "EngineConfig.model": "--model",
    "EngineConfig.served_model_name": "--served-model-name",
    "EngineConfig.served_model_aliases": "--served-model-alias",
    "EngineConfig.dtype": "--dtype",
    "EngineConfig.kv_cache_dtype": "--kv-cache-dtype",
    "EngineConfig.device": "--device",
    "EngineConfig.max_model_len": "--max-model-len",
    "EngineConfig.max_sequences_per_request": "--max-sequences-per-request",
    "EngineConfig.max_logprobs": "--max-logprobs",
    "EngineConfig.seed": "--seed",
    "EngineConfig.num_threads": "--num-threads",
    "EngineConfig.attention_backend": "--attention-backend",
    "EngineConfig.debug_kv_integrity": "--debug-kv-integrity",
    "CacheConfig.block_size": "--block-size",
    "CacheConfig.num_blocks": "--num-kv-blocks",
    "CacheConfig.kv_memory_bytes": "--kv-memory-mib",
    "CacheConfig.enable_prefix_caching": "--no-prefix-caching",
    "SchedulerConfig.max_num_batched_tokens": "--max-num-batched-tokens",
    "SchedulerConfig.max_num_seqs": "--max-num-seqs",
    "SchedulerConfig.max_active_requests": "--max-active-requests",
    "KernelConfig.native_cpu_kernels": "--no-native-kernels",
    "KernelConfig.onednn_linear": "--no-onednn",
    "KernelConfig.cuda_graphs": "--no-cuda-graphs",
    "KernelConfig.device_sampling": "--no-device-sampling",
    "GuidedConfig.default_backend": "--guided-default-backend",
    "GuidedConfig.compile_timeout_seconds": "--guided-compile-timeout",
    "GuidedConfig.max_token_seconds": "--guided-max-token-seconds",
    "GuidedConfig.compile_threads": "--guided-compile-threads",
    "GuidedConfig.cache_size": "--guided-cache-size",
    "GuidedConfig.cache_bytes": "--guided-cache-mib",
    "GuidedConfig.max_spec_bytes": "--guided-max-spec-kib",
    "GuidedConfig.max_choices": "--guided-max-choices",
    "KvEventsConfig.enabled": "--no-kv-events",
    "KvEventsConfig.retained_batches": "--kv-events-retained-batches",
    "KvEventsConfig.subscriber_buffer": "--kv-events-subscriber-buffer",
    "EngineConfig.role": "--role",
    "KvTransferConfig.backend": "--kv-transfer-backend",
    "KvTransferConfig.session_ttl_seconds": "--kv-session-ttl",
    "KvTransferConfig.chunk_bytes": "--kv-pull-chunk-kib",
    "KvTransferConfig.num_transfer_threads": "--kv-transfer-threads",
    "KvTransferConfig.pull_timeout_seconds": "--kv-pull-timeout",
    "KvTransferConfig.allowed_sources": "--kv-source-allow",
    "LoraConfig.enabled": "--enable-lora",
    "LoraConfig.roots": "--lora-root",
    "LoraConfig.max_loras": "--max-loras",
    "LoraConfig.max_lora_rank": "--max-lora-rank",
    "LoraConfig.max_loaded_loras": "--max-loaded-loras",
    "MediaConfig.max_items": "--media-max-items",
    "MediaConfig.max_bytes": "--media-max-mib",
    "MediaConfig.max_pixels": "--media-max-pixels",
    "MediaConfig.max_aspect_ratio": "--media-max-aspect-ratio",
    "MediaConfig.image_formats": "--media-image-format",
    "MediaConfig.url_allow_hosts": "--media-url-allow",
    "MediaConfig.url_allow_private": "--media-url-allow-private",
    "MediaConfig.url_timeout_seconds": "--media-url-timeout",
    "MediaConfig.url_max_redirects": "--media-url-max-redirects",
    "MediaConfig.encoder_cache_bytes": "--media-cache-mib",
    "EncoderConfig.memory_mib": "--encoder-memory-mib",
    "EncoderConfig.max_cached_entries": "--encoder-cache-entries",
    "EncoderConfig.lease_seconds": "--embedding-lease",
    "EncoderConfig.max_lease_seconds": "--embedding-max-lease",
    "EncoderConfig.staging_mib": "--embedding-staging-mib",
    "EncoderConfig.pull_threads": "--embedding-pull-threads",
    "EncoderConfig.pull_timeout_seconds": "--embedding-pull-timeout",
}

def _mib_bytes(mib: float, flag: str) -> int:
    """A MiB flag as bytes; not a finite number, it is refused naming the flag (int() of inf
    raised OverflowError, a traceback)."""
    nbytes = mib * (1 << 20)
    if not math.isfinite(nbytes):  # a finite 1e308 MiB overflows too (found by review)
        raise ValueError(f"{flag}: must be a finite number of MiB, got {mib}")
    return int(nbytes)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The config the flags describe. Raises ValueError, naming the flag and the field,
    when a value is out of range."""
    try:
        return _engine_config(args)
    except ValueError as exc:
        message = str(exc)
        named = [field for field in FIELD_FLAGS if field in message]
        if not named:
            raise
        first = min(named, key=message.index)
        raise ValueError(f"{FIELD_FLAGS[first]}: {message}") from exc


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    scheduler = SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                                max_active_requests=args.max_active_requests)
    if scheduler.max_num_batched_tokens < scheduler.max_num_seqs:
        # Each running sequence needs one token of a step's budget: with fewer tokens than sequences
        # (a request's n outputs fork past it) the first in order take them all and the others'
        # streams stall as long (found by review: an n = 3 request under a budget of 2 left its third
        # output silent for 29 steps). Engines built in code may use tiny budgets (chunking tests).
        raise ValueError(f"SchedulerConfig.max_num_batched_tokens ({scheduler.max_num_batched_tokens}) must be at "
                         f"least --max-num-seqs ({scheduler.max_num_seqs}): every running sequence needs a token "
                         "of each step")
    per_request = args.max_sequences_per_request
    if per_request is None:  # so that a small --max-num-seqs alone stays valid
        per_request = min(EngineConfig().max_sequences_per_request, scheduler.max_num_seqs)
    return EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        served_model_aliases=tuple(args.served_model_aliases),
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_sequences_per_request=per_request,
        max_logprobs=args.max_logprobs,
        seed=args.seed,
        num_threads=args.num_threads,
        attention_backend=args.attention_backend,
        debug_kv_integrity=args.debug_kv_integrity,
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_kv_blocks,
                          kv_memory_bytes=args.kv_memory_mib << MIB_SHIFT,
                          enable_prefix_caching=not args.no_prefix_caching),
        scheduler=scheduler,
        kernels=KernelConfig(native_cpu_kernels=not args.no_native_kernels, onednn_linear=not args.no_onednn,
                             cuda_graphs=not args.no_cuda_graphs, device_sampling=not args.no_device_sampling),
        guided=GuidedConfig(default_backend=args.guided_default_backend,
                            compile_timeout_seconds=args.guided_compile_timeout,
                            max_token_seconds=args.guided_max_token_seconds,
                            compile_threads=args.guided_compile_threads, cache_size=args.guided_cache_size,
                            cache_bytes=_mib_bytes(args.guided_cache_mib, "--guided-cache-mib"),
                            max_spec_bytes=args.guided_max_spec_kib << 10, max_choices=args.guided_max_choices),
        kv_events=KvEventsConfig(enabled=not args.no_kv_events, retained_batches=args.kv_events_retained_batches,
                                 subscriber_buffer=args.kv_events_subscriber_buffer),
        role=args.role,
        kv_transfer=KvTransferConfig(backend=args.kv_transfer_backend, session_ttl_seconds=args.kv_session_ttl,
                                     chunk_bytes=args.kv_pull_chunk_kib << 10,
                                     num_transfer_threads=args.kv_transfer_threads,
                                     pull_timeout_seconds=args.kv_pull_timeout,
                                     allowed_sources=tuple(args.kv_source_allow or KvTransferConfig.allowed_sources)),
        lora=LoraConfig(enabled=args.enable_lora, roots=tuple(os.path.abspath(r) for r in args.lora_root),
                        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                        max_loaded_loras=args.max_loaded_loras),
        media=MediaConfig(max_items=args.media_max_items, max_bytes=_mib_bytes(args.media_max_mib, "--media-max-mib"),
                          max_pixels=args.media_max_pixels, max_aspect_ratio=args.media_max_aspect_ratio,
                          image_formats=tuple(args.media_image_format or MediaConfig().image_formats),
                          url_allow_hosts=tuple(args.media_url_allow), url_allow_private=args.media_url_allow_private,
                          url_timeout_seconds=args.media_url_timeout, url_max_redirects=args.media_url_max_redirects,
                          encoder_cache_bytes=_mib_bytes(args.media_cache_mib, "--media-cache-mib")),
        encoder=EncoderConfig(memory_mib=args.encoder_memory_mib, max_cached_entries=args.encoder_cache_entries,
                              lease_seconds=args.embedding_lease, max_lease_seconds=args.embedding_max_lease,
                              staging_mib=args.embedding_staging_mib, pull_threads=args.embedding_pull_threads,
                              pull_timeout_seconds=args.embedding_pull_timeout),
    )
