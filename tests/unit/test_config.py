"""Configuration (refengine/config.py), its flags (refengine/args.py), the process-wide
settings of the entry points (refengine/runtime.py), and the attention-backend registry."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from refengine import cli
from refengine.args import add_engine_args
from refengine.args_config import FIELD_FLAGS, engine_config_from_args
from refengine.config import (
    ATTENTION_BACKENDS,
    CacheConfig,
    EncoderConfig,
    EngineConfig,
    GuidedConfig,
    KernelConfig,
    KvEventsConfig,
    KvTransferConfig,
    LoraConfig,
    MediaConfig,
    ModelConfig,
    SchedulerConfig,
)
from refengine.kernels.attention import AttentionBackend, AttentionMetadata, TorchReferenceBackend, registry
from refengine.kernels.attention.cpu_paged import native_kernel_unavailable_reason
from refengine.runtime import apply_process_settings

CONFIG_CLASSES = (EngineConfig, CacheConfig, SchedulerConfig, KernelConfig, GuidedConfig, KvEventsConfig,
                  KvTransferConfig, LoraConfig, MediaConfig, EncoderConfig)
MODEL = dict(architecture="LlamaForCausalLM", vocab_size=128, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0)


# ----------------------------------------------------------------------------- validation

BAD_VALUES: list[tuple[str, Callable[[], Any], str]] = [
    ("block_size", lambda: CacheConfig(block_size=0),
     r"CacheConfig\.block_size must be an integer in \[1, \d+\], got 0"),
    ("pool_of_one_token", lambda: CacheConfig(block_size=1, num_blocks=1),
     r"num_blocks x block_size is 1 tokens; a request needs at least 2"),
    ("num_blocks", lambda: CacheConfig(num_blocks=0), r"CacheConfig\.num_blocks .*>= 1 or None, got 0"),
    ("kv_memory_bytes", lambda: CacheConfig(kv_memory_bytes=0), r"CacheConfig\.kv_memory_bytes .*>= 1"),
    ("prefix_caching", lambda: CacheConfig(enable_prefix_caching=1), r"enable_prefix_caching must be True or False"),
    ("batched_tokens", lambda: SchedulerConfig(max_num_batched_tokens=0), r"SchedulerConfig\.max_num_batched_tokens"),
    ("max_num_seqs", lambda: SchedulerConfig(max_num_seqs=-1), r"SchedulerConfig\.max_num_seqs.*in \[1, \d+\], got -1"),
    ("active_requests", lambda: SchedulerConfig(max_active_requests=0), r"SchedulerConfig\.max_active_requests"),
    ("float_for_int", lambda: SchedulerConfig(max_num_seqs=2.0), r"max_num_seqs must be an integer"),
    ("bool_for_int", lambda: CacheConfig(block_size=True), r"block_size must be an integer in \[1, \d+\], got True"),
    ("native_kernels", lambda: KernelConfig(native_cpu_kernels="no"), r"KernelConfig\.native_cpu_kernels"),
    ("onednn", lambda: KernelConfig(onednn_linear=None), r"KernelConfig\.onednn_linear must be True or False"),
    ("dtype", lambda: EngineConfig(dtype="float64"), r"EngineConfig\.dtype must be one of float32, float16, bfloat16"),
    ("cuda_backend_on_cpu", lambda: EngineConfig(attention_backend="flashinfer"),
     r"attention_backend flashinfer runs on cuda, not on cpu"),
    ("cpu_backend_on_cuda", lambda: EngineConfig(attention_backend="cpu", device="cuda:1"),
     r"attention_backend cpu runs on cpu, not on cuda:1"),
    ("backend", lambda: EngineConfig(attention_backend="flash"),
     r"attention_backend must be one of auto, flashinfer, triton, cpu, torch"),
    ("max_model_len", lambda: EngineConfig(max_model_len=1), r"EngineConfig\.max_model_len .*>= 2 or None, got 1"),
    ("max_logprobs", lambda: EngineConfig(max_logprobs=-1), r"EngineConfig\.max_logprobs .*in \[0, \d+\], got -1"),
    ("seed_negative", lambda: EngineConfig(seed=-1), r"EngineConfig\.seed .* in \[0, 18446744073709551615\], got -1"),
    ("seed_too_big", lambda: EngineConfig(seed=1 << 64), r"EngineConfig\.seed must be an integer in \[0, "),
    ("num_threads", lambda: EngineConfig(num_threads=0), r"EngineConfig\.num_threads .*\[1, 4096\] or None, got 0"),
    ("per_request", lambda: EngineConfig(max_sequences_per_request=0), r"max_sequences_per_request .*in \[1, \d+\]"),
    ("model", lambda: EngineConfig(model=""), r"EngineConfig\.model must be a non-empty string"),
    ("served_name", lambda: EngineConfig(served_model_name=""), r"served_model_name must be a non-empty string or"),
    ("device", lambda: EngineConfig(device=""), r"EngineConfig\.device must be a non-empty string"),
    ("debug_kv", lambda: EngineConfig(debug_kv_integrity="yes"), r"debug_kv_integrity must be True or False"),
    ("alias_empty", lambda: EngineConfig(served_model_aliases=("",)), r"an alias must be a non-empty name"),
    ("alias_spaced", lambda: EngineConfig(served_model_aliases=(" a",)), r"without white space around it"),
    ("served_name_blank", lambda: EngineConfig(served_model_name=" "), r"must not begin or end with white space"),
    ("alias_twice", lambda: EngineConfig(served_model_aliases=("a", "a")), r"lists a name twice"),
    ("alias_is_name", lambda: EngineConfig(served_model_name="a", served_model_aliases=("a",)), r"repeats the served"),
    ("alias_list", lambda: EngineConfig(served_model_aliases=["a"]), r"served_model_aliases must be a tuple"),
    ("cache_type", lambda: EngineConfig(cache=SchedulerConfig()), r"EngineConfig\.cache must be a CacheConfig"),
    ("heads", lambda: ModelConfig(**MODEL | dict(num_key_value_heads=3)), r"multiple of num_key_value_heads \(3\)"),
    ("head_dim_odd", lambda: ModelConfig(**MODEL | dict(head_dim=15)), r"ModelConfig\.head_dim must be even"),
    ("vocab", lambda: ModelConfig(**MODEL | dict(vocab_size=0)), r"ModelConfig\.vocab_size .*>= 1, got 0"),
    ("eps", lambda: ModelConfig(**MODEL | dict(rms_norm_eps=0.0)),
     r"ModelConfig\.rms_norm_eps must be a finite number > 0"),
    ("theta", lambda: ModelConfig(**MODEL | dict(rope_theta=float("nan"))), r"ModelConfig\.rope_theta"),
    ("eos", lambda: ModelConfig(**MODEL | dict(eos_token_ids=(2, -1))), r"ModelConfig\.eos_token_ids"),
    ("rope_kind", lambda: ModelConfig(**MODEL | dict(rope_scaling={"rope_type": "yarn", "factor": 4.0})),
     r"ModelConfig\.rope_scaling: RoPE scaling 'yarn' is not implemented"),
    ("rope_llama3_keys", lambda: ModelConfig(**MODEL | dict(rope_scaling={"rope_type": "llama3", "factor": 8.0})),
     r"needs low_freq_factor, high_freq_factor, original_max_position_embeddings"),
    # past the vocabulary: min_tokens suppressed it with an index_put that failed the whole step
    ("eos_vocab", lambda: ModelConfig(**MODEL | dict(eos_token_ids=(MODEL["vocab_size"],))),
     r"ModelConfig\.eos_token_ids must be integers in \[0, vocab_size="),
    ("architecture", lambda: ModelConfig(**MODEL | dict(architecture="")), r"ModelConfig\.architecture"),
    ("lora_root_relative", lambda: LoraConfig(roots=("adapters",)), r"LoraConfig\.roots must be a tuple of absolute"),
    ("lora_slots", lambda: LoraConfig(max_loras=0), r"LoraConfig\.max_loras must be an integer in \[1, 256\]"),
    ("lora_no_root", lambda: LoraConfig(enabled=True), r"LoraConfig\.enabled needs LoraConfig\.roots"),
    ("lora_rank", lambda: LoraConfig(max_lora_rank=0), r"LoraConfig\.max_lora_rank must be an integer"),
    ("lora_loaded", lambda: LoraConfig(max_loras=8, max_loaded_loras=4),
     r"max_loaded_loras \(4\) must be >= max_loras"),
    ("kv_source_cidr", lambda: KvTransferConfig(allowed_sources=("10.0.0.0/33",)),
     r"allowed_sources: '10\.0\.0\.0/33' is not a host name, IP address, CIDR network"),
    ("kv_source_url", lambda: KvTransferConfig(allowed_sources=("http://prefill",)), r"'http://prefill' is not"),
    ("kv_source_type", lambda: KvTransferConfig(allowed_sources=(5,)), r"allowed_sources: 5 is not a string"),
    ("kv_source_none", lambda: KvTransferConfig(allowed_sources=()), r"allowed_sources must be a non-empty tuple"),
]


@pytest.mark.parametrize(("make", "message"), [(m, msg) for _, m, msg in BAD_VALUES],
                         ids=[name for name, _, _ in BAD_VALUES])
def test_bad_values_are_refused_with_the_field_and_range(make: Callable[[], Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_defaults_and_edge_values_are_valid() -> None:
    for kind in CONFIG_CLASSES:
        kind()
    ModelConfig(**MODEL, bos_token_id=1, eos_token_ids=(2,))
    EngineConfig(seed=(1 << 64) - 1, max_model_len=2, max_logprobs=0, num_threads=1,
                 cache=CacheConfig(block_size=1, num_blocks=2, kv_memory_bytes=1),
                 scheduler=SchedulerConfig(max_num_batched_tokens=1, max_num_seqs=1, max_active_requests=1),
                 max_sequences_per_request=1)


def test_configs_are_frozen() -> None:
    for config in (EngineConfig(), CacheConfig(), SchedulerConfig(), KernelConfig()):
        field = dataclasses.fields(config)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(config, field, getattr(config, field))


# ----------------------------------------------------------------------------- the renamed limits


def test_renamed_limits() -> None:
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    scheduler_fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
    assert "max_sequences_per_request" in engine_fields and "max_num_sequences" not in engine_fields
    assert "max_active_requests" in scheduler_fields and "max_waiting_requests" not in scheduler_fields
    assert EngineConfig().max_sequences_per_request == 16
    assert SchedulerConfig().max_active_requests == 4096
    assert EngineConfig().kernels == KernelConfig(native_cpu_kernels=True, onednn_linear=True)
    assert EngineConfig().debug_kv_integrity is False


def test_sequences_per_request_may_not_exceed_max_num_seqs() -> None:
    """A request's outputs all run at once: more than max_num_seqs could never be scheduled."""
    EngineConfig(max_sequences_per_request=4, scheduler=SchedulerConfig(max_num_seqs=4))
    with pytest.raises(ValueError, match=r"max_sequences_per_request \(5\) must be <= SchedulerConfig\.max_num_seqs "
                                         r"\(4\)"):
        EngineConfig(max_sequences_per_request=5, scheduler=SchedulerConfig(max_num_seqs=4))


# ----------------------------------------------------------------------------- flags


def parse(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(list(argv)))


def get(config: EngineConfig, field: str) -> Any:
    """``field`` is ``Class.name`` as in FIELD_FLAGS; nested configs are found by type."""
    owner, name = field.split(".")
    part = {"EngineConfig": config, "CacheConfig": config.cache, "SchedulerConfig": config.scheduler,
            "KernelConfig": config.kernels, "GuidedConfig": config.guided, "KvEventsConfig": config.kv_events,
            "KvTransferConfig": config.kv_transfer, "LoraConfig": config.lora, "MediaConfig": config.media,
            "EncoderConfig": config.encoder}[owner]
    return getattr(part, name)


# One non-default setting per field: (flags, field, the value the field then holds).
FLAG_SETTINGS = [
    (["--model", "/models/x.gguf"], "EngineConfig.model", "/models/x.gguf"),
    (["--served-model-name", "x"], "EngineConfig.served_model_name", "x"),
    (["--served-model-alias", "a", "--served-model-alias", "b"], "EngineConfig.served_model_aliases", ("a", "b")),
    (["--dtype", "bfloat16"], "EngineConfig.dtype", "bfloat16"),
    (["--kv-cache-dtype", "bfloat16"], "EngineConfig.kv_cache_dtype", "bfloat16"),
    (["--device", "cuda:1"], "EngineConfig.device", "cuda:1"),
    (["--max-model-len", "512"], "EngineConfig.max_model_len", 512),
    (["--max-sequences-per-request", "3"], "EngineConfig.max_sequences_per_request", 3),
    (["--max-logprobs", "5"], "EngineConfig.max_logprobs", 5),
    (["--seed", "7"], "EngineConfig.seed", 7),
    (["--num-threads", "2"], "EngineConfig.num_threads", 2),
    (["--attention-backend", "torch"], "EngineConfig.attention_backend", "torch"),
    (["--debug-kv-integrity"], "EngineConfig.debug_kv_integrity", True),
    (["--block-size", "8"], "CacheConfig.block_size", 8),
    (["--num-kv-blocks", "99"], "CacheConfig.num_blocks", 99),
    (["--kv-memory-mib", "3"], "CacheConfig.kv_memory_bytes", 3 << 20),
    (["--no-prefix-caching"], "CacheConfig.enable_prefix_caching", False),
    (["--max-num-batched-tokens", "100"], "SchedulerConfig.max_num_batched_tokens", 100),
    (["--max-num-seqs", "32"], "SchedulerConfig.max_num_seqs", 32),
    (["--max-active-requests", "10"], "SchedulerConfig.max_active_requests", 10),
    (["--no-native-kernels"], "KernelConfig.native_cpu_kernels", False),
    (["--no-onednn"], "KernelConfig.onednn_linear", False),
    (["--no-cuda-graphs"], "KernelConfig.cuda_graphs", False),
    (["--no-device-sampling"], "KernelConfig.device_sampling", False),
    (["--guided-default-backend", "llguidance"], "GuidedConfig.default_backend", "llguidance"),
    (["--guided-compile-timeout", "0.5"], "GuidedConfig.compile_timeout_seconds", 0.5),
    (["--guided-max-token-seconds", "0.5"], "GuidedConfig.max_token_seconds", 0.5),
    (["--guided-compile-threads", "3"], "GuidedConfig.compile_threads", 3),
    (["--guided-cache-size", "8"], "GuidedConfig.cache_size", 8),
    (["--guided-cache-mib", "8"], "GuidedConfig.cache_bytes", 8 << 20),
    (["--guided-max-spec-kib", "4"], "GuidedConfig.max_spec_bytes", 4 << 10),
    (["--guided-max-choices", "9"], "GuidedConfig.max_choices", 9),
    (["--no-kv-events"], "KvEventsConfig.enabled", False),
    (["--kv-events-retained-batches", "5"], "KvEventsConfig.retained_batches", 5),
    (["--kv-events-subscriber-buffer", "3"], "KvEventsConfig.subscriber_buffer", 3),
    (["--role", "decode"], "EngineConfig.role", "decode"),
    (["--kv-transfer-backend", "nixl"], "KvTransferConfig.backend", "nixl"),
    (["--kv-session-ttl", "5"], "KvTransferConfig.session_ttl_seconds", 5.0),
    (["--kv-pull-chunk-kib", "64"], "KvTransferConfig.chunk_bytes", 64 << 10),
    (["--kv-transfer-threads", "2"], "KvTransferConfig.num_transfer_threads", 2),
    (["--kv-pull-timeout", "7"], "KvTransferConfig.pull_timeout_seconds", 7.0),
    (["--kv-source-allow", "10.0.0.0/8", "--kv-source-allow", "prefill-0"], "KvTransferConfig.allowed_sources",
     ("10.0.0.0/8", "prefill-0")),
    (["--enable-lora", "--lora-root", "/srv/a"], "LoraConfig.enabled", True),
    (["--lora-root", "/srv/a", "--lora-root", "/srv/b"], "LoraConfig.roots", ("/srv/a", "/srv/b")),
    (["--max-loras", "2"], "LoraConfig.max_loras", 2),
    (["--max-lora-rank", "8"], "LoraConfig.max_lora_rank", 8),
    (["--max-loaded-loras", "9"], "LoraConfig.max_loaded_loras", 9),
    (["--media-max-items", "2"], "MediaConfig.max_items", 2),
    (["--media-max-mib", "1"], "MediaConfig.max_bytes", 1 << 20),
    (["--media-max-pixels", "1000"], "MediaConfig.max_pixels", 1000),
    (["--media-max-aspect-ratio", "20"], "MediaConfig.max_aspect_ratio", 20),
    (["--media-image-format", "PNG"], "MediaConfig.image_formats", ("PNG",)),
    (["--media-url-allow", "img.example"], "MediaConfig.url_allow_hosts", ("img.example",)),
    (["--media-url-allow-private"], "MediaConfig.url_allow_private", True),
    (["--media-url-timeout", "3"], "MediaConfig.url_timeout_seconds", 3.0),
    (["--media-url-max-redirects", "0"], "MediaConfig.url_max_redirects", 0),
    (["--media-cache-mib", "0.5"], "MediaConfig.encoder_cache_bytes", 1 << 19),
    (["--encoder-memory-mib", "3"], "EncoderConfig.memory_mib", 3),
    (["--encoder-cache-entries", "0"], "EncoderConfig.max_cached_entries", 0),
    (["--embedding-lease", "5"], "EncoderConfig.lease_seconds", 5.0),
    (["--embedding-max-lease", "900"], "EncoderConfig.max_lease_seconds", 900.0),
    (["--embedding-staging-mib", "8"], "EncoderConfig.staging_mib", 8),
    (["--embedding-pull-threads", "3"], "EncoderConfig.pull_threads", 3),
    (["--embedding-pull-timeout", "7"], "EncoderConfig.pull_timeout_seconds", 7.0),
]


def test_every_config_field_has_a_flag() -> None:
    fields = {f"{kind.__name__}.{f.name}" for kind in CONFIG_CLASSES for f in dataclasses.fields(kind)
              if not dataclasses.is_dataclass(f.type)
              and f.name not in ("cache", "scheduler", "kernels", "guided", "kv_events", "kv_transfer", "lora",
                                 "media", "encoder")}
    assert set(FIELD_FLAGS) == fields
    assert {field for _, field, _ in FLAG_SETTINGS} == fields
    assert all(FIELD_FLAGS[field] == flags[0] for flags, field, _ in FLAG_SETTINGS)


def test_no_flags_give_the_dataclass_defaults() -> None:
    assert parse() == EngineConfig()


@pytest.mark.parametrize(("flags", "field", "value"), FLAG_SETTINGS, ids=[f for _, f, _ in FLAG_SETTINGS])
def test_each_flag_sets_its_field(flags: list[str], field: str, value: Any) -> None:
    config = parse(*flags)
    assert get(config, field) == value != get(EngineConfig(), field)
    needs = {"LoraConfig.enabled": "LoraConfig.roots"}  # a flag that needs another (given with it)
    others = [f for f in FIELD_FLAGS if f not in (field, needs.get(field), "EngineConfig.max_sequences_per_request")]
    assert all(get(config, f) == get(EngineConfig(), f) for f in others), "one flag, one field"


def test_sequences_per_request_default_follows_a_smaller_max_num_seqs() -> None:
    """--max-num-seqs 4 alone stays valid (as before the limit had one owner): the per-request
    default is 16 or --max-num-seqs, whichever is smaller; an explicit larger value is an error."""
    assert parse("--max-num-seqs", "4").max_sequences_per_request == 4
    assert parse("--max-num-seqs", "100").max_sequences_per_request == 16
    with pytest.raises(ValueError, match=r"^--max-sequences-per-request: EngineConfig\.max_sequences_per_request"):
        parse("--max-num-seqs", "4", "--max-sequences-per-request", "8")


def test_a_token_budget_below_max_num_seqs_is_refused() -> None:
    """Every running sequence needs a token of each step: a smaller budget starved the outputs
    last in order (found by review: an n = 3 request under a budget of 2 left its third output
    silent for 29 steps), as vLLM refuses it too. Equal is fine."""
    with pytest.raises(ValueError, match=r"^--max-num-batched-tokens: .*\(2\) must be at least --max-num-seqs \(4\)"):
        parse("--max-num-batched-tokens", "2", "--max-num-seqs", "4")
    assert parse("--max-num-batched-tokens", "4", "--max-num-seqs", "4").scheduler.max_num_batched_tokens == 4


def test_deprecated_max_num_sequences_alias(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse("--max-num-sequences", "3").max_sequences_per_request == 3
    assert "--max-num-sequences is deprecated; use --max-sequences-per-request" in capsys.readouterr().err


def test_flag_errors_name_the_flag_and_the_field() -> None:
    with pytest.raises(ValueError, match=r"^--block-size: CacheConfig\.block_size must be an integer in \[1, \d+\], "
                                         r"got 0$"):
        parse("--block-size", "0")
    with pytest.raises(ValueError, match=r"^--kv-memory-mib: CacheConfig\.kv_memory_bytes"):
        parse("--kv-memory-mib", "0")
    with pytest.raises(ValueError, match=r"^--seed: EngineConfig\.seed"):
        parse("--seed", "-1")
    with pytest.raises(ValueError, match=r"^--kv-source-allow: KvTransferConfig\.allowed_sources: 'a b' is not"):
        parse("--kv-source-allow", "a b")


def serve_parser() -> argparse.ArgumentParser:
    subparsers = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices["serve"]


def test_every_engine_flag_help_states_its_default() -> None:
    """Whatever the formatter (the benchmarks use a plain one): each help names its default,
    and a None default is said in words, never as a bare "None" from %(default)s."""
    parser = serve_parser()
    engine_flags = set(FIELD_FLAGS.values())
    actions = [a for a in parser._actions if set(a.option_strings) & engine_flags]
    assert {a.option_strings[0] for a in actions} == engine_flags
    for action in actions:
        text = action.help % dict(vars(action), prog=parser.prog)
        assert "(default: " in text, f"{action.option_strings[0]}: {text}"
        if action.default is None or action.default is False or action.default == []:
            assert "%(default)" not in action.help, f"{action.option_strings[0]} shows a bare {action.default!r}"


def test_serve_help_lists_every_flag_once_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in FIELD_FLAGS.values():
        assert f" {flag} " in text, flag
    assert "--max-num-sequences" not in text  # the deprecated alias is hidden
    assert "(default: 16)" in text and "(default: 2048)" in text and "(default: 4096)" in text
    assert "(default: enabled) (default: False)" not in text  # stated once, in words


def test_serve_refuses_a_bad_flag_value_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--block-size", "0"]) == 2
    assert "refengine serve: --block-size: CacheConfig.block_size must be an integer in [1, " in capsys.readouterr().err


def test_config_and_args_import_no_torch() -> None:
    """The gRPC server imports both; the server never touches tensors."""
    code = ("import sys, refengine.config, refengine.args, refengine.runtime; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


# ----------------------------------------------------------------------------- process settings


def test_apply_process_settings_sets_the_thread_count_only_when_asked() -> None:
    threads = torch.get_num_threads()
    try:
        apply_process_settings(EngineConfig())
        assert torch.get_num_threads() == threads
        apply_process_settings(EngineConfig(num_threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- attention backends


def test_config_names_match_the_registry() -> None:
    """config.ATTENTION_BACKENDS (for code that may not import torch) is what the registry offers, in
    its order: the names an unknown backend is told to choose from."""
    with pytest.raises(ValueError, match="choose one of ") as refused:
        registry.make_attention_backend("flash", torch.float32, "cpu", KernelConfig())
    assert str(refused.value).partition("choose one of ")[2] == ", ".join(ATTENTION_BACKENDS)


def test_unknown_backend_lists_the_known_ones() -> None:
    choices = "auto, flashinfer, triton, cpu, torch"
    with pytest.raises(ValueError, match=rf"unknown attention backend 'flash'; choose one of {choices}"):
        registry.make_attention_backend("flash", torch.float32, "cpu", KernelConfig())


def test_unavailable_backend_raises_with_its_reason() -> None:
    with pytest.raises(ValueError, match=r"attention backend 'cpu' is unavailable: it needs float32 \(or bfloat16"):
        registry.make_attention_backend("cpu", torch.float16, "cpu", KernelConfig())
    off = KernelConfig(native_cpu_kernels=False)
    assert "--no-native-kernels" in registry.unavailable_reason("cpu", torch.float32, "cpu", off)
    with pytest.raises(ValueError, match=r"'cpu' is unavailable: disabled by --no-native-kernels"):
        registry.make_attention_backend("cpu", torch.float32, "cpu", off)


def test_auto_falls_back_when_native_kernels_are_disabled() -> None:
    off = KernelConfig(native_cpu_kernels=False)
    assert registry.available_backends(torch.float32, "cpu", off) == ("torch",)
    assert type(registry.make_attention_backend("auto", torch.float32, "cpu", off)) is TorchReferenceBackend


@pytest.mark.skipif(bool(native_kernel_unavailable_reason()), reason="native CPU kernel unavailable")
def test_auto_prefers_the_native_kernel_when_it_builds() -> None:
    from refengine.kernels.attention.cpu_paged import CpuPagedBackend

    assert registry.available_backends(torch.float32, "cpu", KernelConfig()) == ("cpu", "torch")
    assert type(registry.make_attention_backend("auto", torch.float32, "cpu")) is CpuPagedBackend
    assert type(registry.make_attention_backend("auto", torch.float16, "cpu")) is TorchReferenceBackend


def test_registration_order_is_auto_preference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_BACKENDS", {})
    made: list[str] = []

    def factory(name: str) -> Callable[..., TorchReferenceBackend]:
        return lambda dtype, kv_dtype, device, kernels: made.append(name) or TorchReferenceBackend()

    registry.register_backend("fast", factory("fast"), lambda dtype, kv_dtype, device, kernels: "no fast path here")
    registry.register_backend("slow", factory("slow"), lambda dtype, kv_dtype, device, kernels: "")
    registry.make_attention_backend("auto", torch.float32, "cpu", KernelConfig())
    assert made == ["slow"]
    with pytest.raises(ValueError, match="no fast path here"):
        registry.make_attention_backend("fast", torch.float32, "cpu", KernelConfig())
    with pytest.raises(ValueError, match="choose one of auto, fast, slow"):
        registry.make_attention_backend("cpu", torch.float32, "cpu", KernelConfig())
    for name in ("slow", "auto"):
        with pytest.raises(ValueError, match="reserved or already registered"):
            registry.register_backend(name, factory(name), lambda dtype, kv_dtype, device, kernels: "")


def test_cuda_graph_hooks_default_to_no_ops() -> None:
    """A backend that does not override the hooks (the torch reference does: see
    tests/unit/test_cuda_graphs.py) cannot be captured, and its hooks set nothing up."""
    class Plain(AttentionBackend):
        def prepare(self, meta: AttentionMetadata) -> None:
            pass

        def forward(self, q, k, v, k_cache, v_cache, scale):  # noqa: ANN001, ANN202
            return q

    backend = Plain()
    assert backend.supports_cuda_graphs is False
    assert backend.graph_step_ineligible_reason([5, 300], 16) == ""  # no backend-specific refusal
    backend.init_cuda_graph_state(max_num_seqs=4, max_num_blocks_per_seq=8)
    backend.prepare_for_capture(4)
    meta = AttentionMetadata([0, 1], [3], torch.zeros(1, 1, dtype=torch.int64), torch.tensor([2]), block_size=4)
    backend.prepare_for_replay(meta)
    assert backend.__dict__ == {}  # nothing was set up
