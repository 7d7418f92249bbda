"""Tiny random Llama-family models for fast tests, with transformers as the oracle."""

from __future__ import annotations

import torch
import transformers

from refengine.config import ModelConfig


def make_tiny_hf_model(
    arch: str = "llama", seed: int = 0, tie: bool = False, vocab_size: int = 128, **overrides
) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(overrides)
    if arch == "qwen2":
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    # Random init is tiny-valued; widen it so logits differ meaningfully between tokens.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.08)
    return model.float().eval()


def model_config_from_hf(model: transformers.PreTrainedModel) -> ModelConfig:
    c = model.config
    eos = c.eos_token_id
    return ModelConfig(
        architecture=c.architectures[0] if c.architectures else type(model).__name__,
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"],
        rope_scaling=_rope_scaling(c),
        tie_word_embeddings=c.tie_word_embeddings,
        attention_bias=isinstance(model, transformers.Qwen2ForCausalLM),
        bos_token_id=c.bos_token_id,
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos]),
    )


def _rope_scaling(config: transformers.PretrainedConfig) -> dict | None:
    """transformers 5 gives every model a rope dict (``rope_type`` 'default' for plain RoPE);
    ModelConfig holds None for plain RoPE."""
    rope = getattr(config, "rope_scaling", None)
    return None if not rope or rope.get("rope_type", "default") == "default" else dict(rope)


def hf_weights(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
