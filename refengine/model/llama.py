"""The Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2/2.5, SmolLM2).

Stateless over requests: the runner passes token ids, positions, the attention
backend (already prepared for this step) and the KV cache tensors. Q/K/V and
gate/up projections are fused into one matmul each, loaded from the Hugging
Face per-projection weights; each projection is a ``kernels.linear.Linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from refengine.config import ModelConfig
from refengine.kernels.attention.base import AttentionBackend
from refengine.kernels.fused import add_rms_norm, silu_and_mul
from refengine.kernels.linear import Linear
from refengine.model.rope import RotaryEmbedding

KvCaches = list[tuple[torch.Tensor, torch.Tensor]]


class LlamaLayer:
    def __init__(self, weights: dict[str, torch.Tensor], prefix: str, config: ModelConfig) -> None:
        attn = f"{prefix}.self_attn"
        mlp = f"{prefix}.mlp"
        self.input_norm = weights[f"{prefix}.input_layernorm.weight"]
        self.post_attn_norm = weights[f"{prefix}.post_attention_layernorm.weight"]
        self.qkv_proj = Linear(
            torch.cat([weights[f"{attn}.{p}_proj.weight"] for p in "qkv"]),
            torch.cat([weights[f"{attn}.{p}_proj.bias"] for p in "qkv"]) if config.attention_bias else None,
        )
        self.o_proj = Linear(weights[f"{attn}.o_proj.weight"])
        self.gate_up_proj = Linear(torch.cat([weights[f"{mlp}.gate_proj.weight"], weights[f"{mlp}.up_proj.weight"]]))
        self.down_proj = Linear(weights[f"{mlp}.down_proj.weight"])


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], max_positions: int) -> None:
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.embed_tokens = weights["model.embed_tokens.weight"]
        self.layers = [LlamaLayer(weights, f"model.layers.{i}", config) for i in range(config.num_hidden_layers)]
        self.norm = weights["model.norm.weight"]
        self.lm_head = Linear(self.embed_tokens if config.tie_word_embeddings else weights["lm_head.weight"])
        self.rope = RotaryEmbedding(config, max_positions, self.embed_tokens.dtype, str(self.embed_tokens.device))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attn: AttentionBackend,
        kv_caches: KvCaches,
    ) -> torch.Tensor:  # [T, hidden]
        eps = self.config.rms_norm_eps
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        # ``hidden`` is the residual stream: each add_rms_norm adds a sublayer's output
        # to it in place and returns the normalized input of the next sublayer.
        hidden = F.embedding(input_ids, self.embed_tokens)
        x = add_rms_norm(hidden, None, self.layers[0].input_norm, eps)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            qkv = layer.qkv_proj(x)
            # Queries and keys are rotated together, in place, as one [T, heads + kv_heads, D] view.
            qk = qkv[:, : q_size + kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
            self.rope.apply_(qk, positions)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            v = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
            attn_out = attn.forward(q, k, v, k_cache, v_cache, self.scale)
            x = add_rms_norm(hidden, layer.o_proj(attn_out.reshape(-1, q_size)), layer.post_attn_norm, eps)
            mlp_out = layer.down_proj(silu_and_mul(layer.gate_up_proj(x)))
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            x = add_rms_norm(hidden, mlp_out, next_norm, eps)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
