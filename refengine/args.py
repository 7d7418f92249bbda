"""Command-line flags for every ``EngineConfig`` field, shared by ``refengine serve``,
``refengine generate`` and the benchmarks; ``refengine.args_config`` turns them into an
``EngineConfig``.

Each flag's help shows its default (``None`` defaults say what ``None`` means); the
defaults themselves come from the dataclasses in ``refengine/config.py``, the one
place they are written. No torch here: the server builds its config from these flags.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from refengine.args_config import MIB_SHIFT
from refengine.config import (
    ATTENTION_BACKENDS,
    DTYPE_NAMES,
    ENGINE_ROLES,
    GUIDED_BACKENDS,
    TRANSFER_BACKENDS,
    CacheConfig,
    EncoderConfig,
    EngineConfig,
    GuidedConfig,
    KvEventsConfig,
    KvTransferConfig,
    LoraConfig,
    MediaConfig,
    SchedulerConfig,
)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: …)" only to flags whose help does not state its default already
    (the engine flags all do, in words where the bare value would mislead: "None", "False"),
    and not where there is nothing to show (an empty or unset default, a switch off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        nothing = action.default is None or action.default is False or (
            isinstance(action.default, str | list) and not action.default)  # not `in`: 0 == False
        if "(default: " in (action.help or "") or nothing:
            return action.help
        return super()._get_help_string(action)


class _DeprecatedAlias(argparse.Action):
    """An old flag name: hidden from ``--help``, sets the new flag's value, warns once."""

    def __init__(self, option_strings: Sequence[str], dest: str, replacement: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.replacement = replacement

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"{parser.prog}: {option_string} is deprecated; use {self.replacement}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the engine, KV cache, scheduler and kernel flags to ``parser``."""
    _add_model_args(parser.add_argument_group("engine"))
    _add_cache_args(parser.add_argument_group("KV cache"))
    _add_scheduler_args(parser.add_argument_group("scheduler"))
    _add_kernel_args(parser.add_argument_group("kernels"))
    _add_guided_args(parser.add_argument_group("guided decoding"))
    _add_kv_event_args(parser.add_argument_group("KV events"))
    _add_kv_transfer_args(parser.add_argument_group("disaggregated prefill/decode"))
    _add_lora_args(parser.add_argument_group("LoRA adapters"))
    _add_media_args(parser.add_argument_group("media (multimodal models)"))
    _add_encoder_args(parser.add_argument_group("embedding handles (draft profile encoder: --role encoder and "
                                                "its consumers)"))


def _add_media_args(g: argparse._ArgumentGroup) -> None:
    d = MediaConfig()
    g.add_argument("--media-max-items", type=int, default=d.max_items,
                   help="media items one request may carry (default: %(default)s)")
    g.add_argument("--media-max-mib", type=float, default=d.max_bytes / (1 << 20),
                   help="encoded size of one media item, MiB (default: %(default)s)")
    g.add_argument("--media-max-pixels", type=int, default=d.max_pixels,
                   help="width x height of one decoded image (default: %(default)s)")
    g.add_argument("--media-max-aspect-ratio", type=int, default=d.max_aspect_ratio,
                   help="long side / short side of one image: preprocessing scales the short side up, so a "
                   "thin image costs memory its bytes do not show (default: %(default)s)")
    g.add_argument("--media-image-format", action="append", default=None, metavar="FORMAT",
                   help=f"an accepted Pillow image format, repeatable (default: {', '.join(d.image_formats)})")
    g.add_argument("--media-url-allow", action="append", default=[], metavar="HOST",
                   help="a host url media may be fetched from, repeatable (default: none, so url fetching is off)")
    g.add_argument("--media-url-allow-private", action="store_true",
                   help="also fetch from hosts resolving to loopback, private, link-local or other "
                   "non-global addresses: an SSRF risk (default: off)")
    g.add_argument("--media-url-timeout", type=float, default=d.url_timeout_seconds, metavar="SECONDS",
                   help="the longest one url fetch may take, redirects included (default: %(default)s)")
    g.add_argument("--media-url-max-redirects", type=int, default=d.url_max_redirects,
                   help="redirects one url fetch follows, each re-checked (default: %(default)s)")
    g.add_argument("--media-cache-mib", type=float, default=d.encoder_cache_bytes / (1 << 20),
                   help="memory for encoded images kept for reuse, on the model's device, beside the KV "
                   "pool, MiB; 0 = off (default: %(default)s)")


def _add_lora_args(g: argparse._ArgumentGroup) -> None:
    d = LoraConfig()
    g.add_argument("--enable-lora", action="store_true",
                   help="serve PEFT LoRA adapters: LoadLora / UnloadLora / ListLoras and GenerateRequest.lora_name "
                   "(default: off)")
    g.add_argument("--lora-root", action="append", default=[], metavar="DIR",
                   help="a directory adapters may be loaded from, repeatable: source_path must resolve inside one "
                   "(default: none, so no adapter loads)")
    g.add_argument("--max-loras", type=int, default=d.max_loras,
                   help="adapter slots: the most distinct adapters running at once (default: %(default)s)")
    g.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                   help="the largest adapter rank accepted (default: %(default)s)")
    g.add_argument("--max-loaded-loras", type=int, default=d.max_loaded_loras,
                   help="the most adapters loaded at once, in host memory (default: %(default)s)")


def _add_model_args(g: argparse._ArgumentGroup) -> None:
    d = EngineConfig()
    g.add_argument("--model", default=d.model, help="manifest name (models/*.toml) or a path to an HF dir "
                   "or a .gguf file (default: %(default)s, the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--served-model-name", default=d.served_model_name,
                   help="name clients use (default: None = the manifest name, or the path's name)")
    g.add_argument("--served-model-alias", action="append", default=[], metavar="NAME", dest="served_model_aliases",
                   help="a further name clients may use for the model, repeatable (ModelInfo.served_model_aliases) "
                   "(default: none)")
    g.add_argument("--dtype", default=d.dtype, choices=DTYPE_NAMES, help="weight and compute dtype, and the KV "
                   "cache's unless --kv-cache-dtype says otherwise; bfloat16 on CPU takes the native path where the "
                   "CPU has bf16 dot products (default: %(default)s)")
    g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=("auto", *DTYPE_NAMES),
                   help="KV cache dtype; auto = --dtype. bfloat16 or float16 under float32 weights: twice the "
                   "blocks per --kv-memory-mib, half the KV bytes read per step; attention still computes in "
                   "--dtype (default: %(default)s)")
    g.add_argument("--device", default=d.device, help="torch device (default: %(default)s)")
    g.add_argument("--attention-backend", default=d.attention_backend, choices=ATTENTION_BACKENDS,
                   help="auto: the first available of flashinfer (CUDA, 16-bit), triton (CUDA), cpu (the native "
                   "paged kernel: float32, or bfloat16 on CPUs with native bf16, on a float32, bfloat16 or float16 "
                   "cache; built with the machine's C compiler on first use) and torch (the reference) "
                   "(default: %(default)s)")
    g.add_argument("--max-model-len", type=int, default=d.max_model_len,
                   help="context limit in tokens, >= 2 (default: None = the model's own limit, bounded by what "
                   "the KV pool holds for one sequence)")
    g.add_argument("--max-sequences-per-request", type=int, default=None,
                   help=f"most outputs one request may ask for (num_sequences); at most --max-num-seqs "
                   f"(default: {d.max_sequences_per_request}, or --max-num-seqs when that is smaller)")
    g.add_argument("--max-num-sequences", type=int, dest="max_sequences_per_request", action=_DeprecatedAlias,
                   replacement="--max-sequences-per-request")
    g.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                   help="largest top-N logprob candidate count a request may ask for (default: %(default)s)")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of the shared sampling generator, used by "
                   "requests without their own seed; 0 <= seed < 2**64 (default: %(default)s)")
    g.add_argument("--num-threads", type=int, default=d.num_threads, help="torch CPU threads, shared by the "
                   "native kernels; 1 is faster on a busy machine (default: None = torch's default, one per core)")
    g.add_argument("--debug-kv-integrity", action="store_true",
                   help="check the KV pool's block accounting each time the engine goes idle (default: off)")


def _add_cache_args(g: argparse._ArgumentGroup) -> None:
    c = CacheConfig()
    g.add_argument("--block-size", type=int, default=c.block_size, help="tokens per KV block (default: %(default)s)")
    g.add_argument("--num-kv-blocks", type=int, default=c.num_blocks,
                   help="KV blocks in the pool (default: None = as many as --kv-memory-mib holds)")
    g.add_argument("--kv-memory-mib", type=int, default=c.kv_memory_bytes >> MIB_SHIFT,
                   help="KV cache memory budget in MiB, used when --num-kv-blocks is not given (default: %(default)s)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache (default: enabled)")


def _add_scheduler_args(g: argparse._ArgumentGroup) -> None:
    s = SchedulerConfig()
    g.add_argument("--max-num-batched-tokens", type=int, default=s.max_num_batched_tokens,
                   help="per-step token budget, shared by prefill chunks and decodes (default: %(default)s)")
    g.add_argument("--max-num-seqs", type=int, default=s.max_num_seqs,
                   help="most sequences running at once; each output of a request counts (default: %(default)s)")
    g.add_argument("--max-active-requests", type=int, default=s.max_active_requests,
                   help="most accepted, unfinished requests (waiting or running); more are refused as "
                   "overloaded (default: %(default)s)")


def _add_kernel_args(g: argparse._ArgumentGroup) -> None:
    # Every KernelConfig switch defaults to on, so the flags turn them off.
    g.add_argument("--no-native-kernels", action="store_true",
                   help="never build or use the C kernels (attention, fused norm/rope/activation); the torch "
                   "paths run instead (default: used where they fit)")
    g.add_argument("--no-onednn", action="store_true",
                   help="run projections with F.linear instead of oneDNN on prepacked weights (default: oneDNN "
                   "on CPU, when available, for float32 and for bfloat16 weights the native GEMMs do not take)")
    g.add_argument("--no-cuda-graphs", action="store_true",
                   help="run every decode step eagerly instead of replaying CUDA graphs captured per padded batch "
                   "size (default: graphs on CUDA when the attention backend supports capture; never on CPU)")
    g.add_argument("--no-device-sampling", action="store_true",
                   help="copy each step's logits to the CPU and sample there (default: on a GPU, sample on the "
                   "GPU: only the chosen token ids come back; no effect on CPU)")


def _add_guided_args(g: argparse._ArgumentGroup) -> None:
    d = GuidedConfig()
    g.add_argument("--guided-default-backend", choices=GUIDED_BACKENDS, default=d.default_backend,
                   help="grammar backend for requests that name none (default: %(default)s)")
    g.add_argument("--guided-compile-timeout", type=float, default=d.compile_timeout_seconds, metavar="SECONDS",
                   help="a grammar that takes longer to compile is refused (INVALID_ARGUMENT) (default: %(default)s)")
    g.add_argument("--guided-max-token-seconds", type=float, default=d.max_token_seconds, metavar="SECONDS",
                   help="a grammar whose matching of one token takes longer fails its request (INVALID_ARGUMENT); "
                   "the step waits for it (default: %(default)s)")
    g.add_argument("--guided-compile-threads", type=int, default=d.compile_threads,
                   help="worker threads that compile grammars (default: %(default)s)")
    g.add_argument("--guided-cache-size", type=int, default=d.cache_size,
                   help="compiled grammars kept, least recently used dropped first (default: %(default)s)")
    g.add_argument("--guided-cache-mib", type=float, default=d.cache_bytes / (1 << 20),
                   help="memory the kept grammars' token masks may hold, MiB (default: %(default)s)")
    g.add_argument("--guided-max-spec-kib", type=int, default=d.max_spec_bytes >> 10,
                   help="largest schema, regex, grammar or structural tag, KiB (default: %(default)s)")
    g.add_argument("--guided-max-choices", type=int, default=d.max_choices,
                   help="most entries of a choice constraint (default: %(default)s)")


def _add_encoder_args(g: argparse._ArgumentGroup) -> None:
    d = EncoderConfig()
    g.add_argument("--encoder-memory-mib", type=int, default=d.memory_mib,
                   help="encoder role: host memory for embeddings of live handles and of the encoder cache, MiB "
                   "(default: %(default)s)")
    g.add_argument("--encoder-cache-entries", type=int, default=d.max_cached_entries,
                   help="encoder role: encoded items no handle holds kept for reuse (default: %(default)s)")
    g.add_argument("--embedding-lease", type=float, default=d.lease_seconds, metavar="SECONDS",
                   help="encoder role: a handle's lease when Encode names none (default: %(default)s)")
    g.add_argument("--embedding-max-lease", type=float, default=d.max_lease_seconds, metavar="SECONDS",
                   help="encoder role: the longest lease Encode or RenewLease grants (default: %(default)s)")
    g.add_argument("--embedding-staging-mib", type=int, default=d.staging_mib,
                   help="consumers: host memory handles are pulled into, MiB (default: %(default)s)")
    g.add_argument("--embedding-pull-threads", type=int, default=d.pull_threads,
                   help="consumers: handle pulls run at once, at most this less one from one encoder "
                   "(default: %(default)s)")
    g.add_argument("--embedding-pull-timeout", type=float, default=d.pull_timeout_seconds, metavar="SECONDS",
                   help="consumers: a handle pull taking longer ends its request (default: %(default)s)")


def _add_kv_event_args(g: argparse._ArgumentGroup) -> None:
    d = KvEventsConfig()
    g.add_argument("--no-kv-events", action="store_true",
                   help="do not record or publish prefix-cache events (default: published)")
    g.add_argument("--kv-events-retained-batches", type=int, default=d.retained_batches,
                   help="newest event batches kept for replay (default: %(default)s)")
    g.add_argument("--kv-events-subscriber-buffer", type=int, default=d.subscriber_buffer,
                   help="batches one subscriber may hold unread before it is cut off (default: %(default)s)")


def _add_kv_transfer_args(g: argparse._ArgumentGroup) -> None:
    d, t = EngineConfig(), KvTransferConfig()
    g.add_argument("--role", choices=ENGINE_ROLES, default=d.role,
                   help="aggregated: prompt and output here; prefill: compute the prompt's KV and first token, "
                   "end with PrefillReady and hold the KV as a session; decode: continue a prefill engine's "
                   "session (kv.session); encoder: a multimodal model's vision path only, serving "
                   "refengine.v1alpha1.Media (default: %(default)s)")
    g.add_argument("--kv-transfer-backend", choices=TRANSFER_BACKENDS, default=t.backend,
                   help="how a prefill engine offers its sessions: grpc (refengine.kvpull.v1 on this port) or "
                   "nixl (needs the nixl package); a decode engine takes both (default: %(default)s)")
    g.add_argument("--kv-session-ttl", type=float, default=t.session_ttl_seconds, metavar="SECONDS",
                   help="lease of a session no decode engine has pulled; its KV is freed at expiry "
                   "(default: %(default)s)")
    g.add_argument("--kv-pull-chunk-kib", type=int, default=t.chunk_bytes >> 10,
                   help="most KV bytes in one gRPC pull chunk, KiB, kept within --max-send-message-mib "
                   "(default: %(default)s)")
    g.add_argument("--kv-transfer-threads", type=int, default=t.num_transfer_threads,
                   help="pulls a decode engine runs at once, at most this less one from one prefill server "
                   "(default: %(default)s)")
    g.add_argument("--kv-pull-timeout", type=float, default=t.pull_timeout_seconds, metavar="SECONDS",
                   help="a pull taking longer fails with KV_TRANSFER_FAILED (default: %(default)s)")
    g.add_argument("--kv-source-allow", action="append", metavar="SOURCE",
                   help="a server this one may pull KV sessions and embedding handles from: a host name (not "
                   "resolved), an IP address or CIDR network, 'loopback' (this host: loopback addresses, localhost, "
                   "its host name) or 'any' (every client trusted to name sources); repeatable; a request naming "
                   "another is INVALID_ARGUMENT (default: "
                   f"{' '.join(t.allowed_sources)})")
