"""The frozen ``EngineInfo`` of a loaded engine, from its configuration and model; and the
kernel paths it runs (attention backend and why, the CPU bf16 path), logged at start-up."""

from __future__ import annotations

import logging

from refengine.config import EngineConfig, ModelConfig
from refengine.engine.interface import EngineInfo
from refengine.model.dtypes import DTYPES
from refengine.sampling.guided import backend_modes

logger = logging.getLogger(__name__)


def configured_context(config: EngineConfig, model_config: ModelConfig) -> int:
    """``max_model_len`` as configured (the model's ``max_position_embeddings`` when not given),
    never past the model's, saying so (found by review: clamped without a word); a pool too small
    for it bounds it later (``context_bounded_by_pool``)."""
    limit = model_config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > limit:
        logger.warning("--max-model-len %d is past the model's max_position_embeddings %d: serving a %d-token "
                       "context", config.max_model_len, limit, limit)
    return min(config.max_model_len or limit, limit)


def kernel_paths(config: EngineConfig) -> tuple[str, str, str]:
    """(attention backend, why it was chosen, the CPU bf16 path or ""), as ServerInfo.extra
    reports them (the registry logs the choice); logs the bf16 path, warning when the CPU
    emulates bf16."""
    from refengine.kernels.attention import registry
    from refengine.kernels.cpu_features import bf16_path, native_bf16
    from refengine.kernels.linear import bf16_gemm

    chosen, why = registry.choose_backend(config.attention_backend, DTYPES[config.dtype], config.device,
                                          config.kernels, DTYPES[config.kv_dtype])
    if config.kv_dtype != config.dtype:
        logger.info("KV cache in %s under %s weights (--kv-cache-dtype); attention computes in %s",
                    config.kv_dtype, config.dtype, config.dtype)
    on_cpu_bf16 = config.dtype == "bfloat16" and config.device == "cpu"
    bf16 = (bf16_path(bf16_gemm(config.kernels.native_cpu_kernels), bf16_attention_path(chosen, config.kv_dtype))
            if on_cpu_bf16 else "")
    if bf16:
        (logger.info if native_bf16() else logger.warning)("--dtype bfloat16 on CPU: %s", bf16)
    return chosen, why, bf16


def bf16_attention_path(backend: str, kv_dtype: str) -> str:
    """What computes bf16 attention on the CPU under ``backend`` over a ``kv_dtype`` cache, for
    ``bf16_path``. Only a bf16 cache is read by bf16 dot products; over another the kernel widens
    the queries to float32 (found by review: the line named vdpbf16ps over a float16 cache)."""
    if backend != "cpu":
        return f"the {backend} attention backend on a {kv_dtype} KV cache"
    from refengine.kernels.attention.cpu_paged import amx_form_available, bf16_query_form

    form = bf16_query_form() if kv_dtype == "bfloat16" else None
    dots = f"dot products by {form.name}: {form.why}" if form else "queries widened to float32"
    if kv_dtype == "bfloat16" and amx_form_available():
        dots = f"dot products on AMX tiles where head_dim is a multiple of 32, else {dots}"
    return f"the native attention kernel on a {kv_dtype} KV cache (fp32 accumulation; {dots})"


def engine_info(config: EngineConfig, model_config: ModelConfig, served_model_name: str, max_model_len: int,
                num_blocks: int, kv_transfer_backends: tuple[str, ...] = (), multimodal: bool = False,
                kernels: tuple[str, str, str] = ("", "", "")) -> EngineInfo:
    """``kernels``: what ``kernel_paths`` returned (the engine's attention backend and bf16 path)."""
    return EngineInfo(
        served_model_name=served_model_name,
        served_model_aliases=tuple(a for a in config.served_model_aliases if a != served_model_name),
        model_id=config.model,
        vocab_size=model_config.vocab_size,
        max_model_len=max_model_len,
        bos_token_id=model_config.bos_token_id,
        eos_token_ids=tuple(model_config.eos_token_ids),
        max_sequences_per_request=config.max_sequences_per_request,
        max_logprobs=config.max_logprobs,
        kv_block_size=config.cache.block_size,
        total_kv_blocks=num_blocks,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        device=config.device,
        dtype=config.dtype,
        kv_cache_dtype=config.kv_dtype if num_blocks else "",
        guided_modes=backend_modes()[config.guided.default_backend],
        guided_backends=tuple(sorted(backend_modes().items(), key=lambda kv: kv[0] != config.guided.default_backend)),
        role=config.role,
        kv_transfer_backends=kv_transfer_backends,
        max_loras=config.lora.max_loras if config.lora.enabled else 0,
        supports_multimodal=multimodal,
        attention_backend=kernels[0],
        attention_backend_reason=kernels[1],
        cpu_bf16_path=kernels[2],
    )


def context_bounded_by_pool(max_model_len: int, pool_tokens: int) -> int:
    """The context served: the model's, or less when the KV pool cannot hold one sequence of it
    (every request of a longer context would be refused or wait forever); said at start-up."""
    if pool_tokens < max_model_len:
        logger.warning("the KV pool holds %d tokens, less than max_model_len %d: serving a %d-token context "
                       "(raise --num-kv-blocks or --kv-memory-mib for more)", pool_tokens, max_model_len, pool_tokens)
    return min(max_model_len, pool_tokens)
