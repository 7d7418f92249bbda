"""The Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2/2.5, SmolLM2).

Stateless over requests: the runner passes token ids, positions and the step's
``ForwardContext`` (the attention backend prepared for this step, the KV cache
tensors, the step's LoRA batch), which every projection receives. Q/K/V and
gate/up projections are fused into one matmul each, loaded from the Hugging
Face per-projection weights; each projection is a ``kernels.linear.Linear``. In the
native bf16 GEMM the gate/up projection also applies the SiLU (``Linear.applies_silu_and_mul``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from refengine.config import KernelConfig, ModelConfig
from refengine.kernels.forward_context import ForwardContext
from refengine.kernels.fused import FusedOps
from refengine.kernels.linear import Linear
from refengine.kernels.lora_linear import FUSED_PROJECTIONS, LoraLinear
from refengine.model.rope import RotaryEmbedding


class LlamaLayer:
    def __init__(self, weights: dict[str, torch.Tensor], prefix: str, config: ModelConfig, prepack: bool,
                 lora: LoraSlotShape | None, native: bool = True) -> None:
        attn = f"{prefix}.self_attn"
        mlp = f"{prefix}.mlp"
        self.input_norm = weights[f"{prefix}.input_layernorm.weight"]
        self.post_attn_norm = weights[f"{prefix}.post_attention_layernorm.weight"]
        self.qkv_proj = Linear(
            torch.cat([weights[f"{attn}.{p}_proj.weight"] for p in "qkv"]),
            torch.cat([weights[f"{attn}.{p}_proj.bias"] for p in "qkv"]) if config.attention_bias else None,
            prepack=prepack, native=native,
        )
        self.o_proj = Linear(weights[f"{attn}.o_proj.weight"], prepack=prepack, native=native)
        # Without adapters the SiLU may run in the GEMM's epilogue (native bf16); adapters add their
        # deltas to [gate | up] first, so with LoRA the projection returns it and the SiLU runs apart.
        self.gate_up_proj = Linear(torch.cat([weights[f"{mlp}.gate_proj.weight"], weights[f"{mlp}.up_proj.weight"]]),
                                   prepack=prepack, native=native, silu_and_mul=lora is None)
        self.silu_in_gate_up = self.gate_up_proj.applies_silu_and_mul
        self.down_proj = Linear(weights[f"{mlp}.down_proj.weight"], prepack=prepack, native=native)
        if lora is not None:  # the four projections take adapter deltas (kernels/lora_linear.py)
            dtype, device = self.input_norm.dtype, str(self.input_norm.device)
            q_out, kv_out = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
            part_sizes = {"qkv_proj": (q_out, kv_out, kv_out), "o_proj": (config.hidden_size,),
                          "gate_up_proj": (config.intermediate_size,) * 2, "down_proj": (config.hidden_size,)}
            for name, sizes in part_sizes.items():
                projection = LoraLinear(getattr(self, name), sizes, lora.num_slots, lora.max_rank, dtype, device,
                                        native=native)
                setattr(self, name, projection)

    def lora_projections(self) -> dict[str, LoraLinear]:
        return {name: getattr(self, name) for name in FUSED_PROJECTIONS if isinstance(getattr(self, name), LoraLinear)}


@dataclass(frozen=True)
class LoraSlotShape:
    """Room for adapters: ``num_slots`` resident at once, each of rank up to ``max_rank``."""

    num_slots: int
    max_rank: int


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], max_positions: int,
                 kernels: KernelConfig | None = None, lora: LoraSlotShape | None = None) -> None:
        kernels = kernels or KernelConfig()
        self.config = config
        self.ops = FusedOps(native=kernels.native_cpu_kernels)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.embed_tokens = weights["model.embed_tokens.weight"]
        self.layers = [LlamaLayer(weights, f"model.layers.{i}", config, kernels.onednn_linear, lora,
                                  kernels.native_cpu_kernels)
                       for i in range(config.num_hidden_layers)]
        self.norm = weights["model.norm.weight"]
        # ``lm_head.weight`` is present iff the model has its own head (loader.load_weights).
        head = weights.get("lm_head.weight")
        self.lm_head = Linear(self.embed_tokens if head is None else head,
                              prepack=kernels.onednn_linear, native=kernels.native_cpu_kernels)
        self.rope = RotaryEmbedding(config, max_positions, self.embed_tokens.dtype, str(self.embed_tokens.device),
                                    self.ops)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        ctx: ForwardContext,
        input_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,  # (rows, embeddings): media positions
    ) -> torch.Tensor:  # [T, hidden]
        eps = self.config.rms_norm_eps
        q_size = self.num_heads * self.head_dim
        head_split = [self.num_heads, self.num_kv_heads, self.num_kv_heads]
        # ``hidden`` is the residual stream: each add_rms_norm adds a sublayer's output
        # to it in place and returns the normalized input of the next sublayer.
        hidden = F.embedding(input_ids, self.embed_tokens)
        if input_embeds is not None:
            hidden[input_embeds[0]] = input_embeds[1].to(hidden.dtype)
        ops = self.ops
        x = ops.add_rms_norm(hidden, None, self.layers[0].input_norm, eps)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, ctx.kv_caches, strict=True)):
            # [T, heads + 2 kv_heads, D]: views, split with one call (each view op is a dispatch, per layer).
            qkv = layer.qkv_proj(x, ctx).view(-1, sum(head_split), self.head_dim)
            # Queries and keys are rotated together, in place, as one [T, heads + kv_heads, D] view.
            self.rope.apply_(qkv[:, : self.num_heads + self.num_kv_heads], positions)
            q, k, v = qkv.split(head_split, dim=1)
            attn_out = ctx.attention.forward(q, k, v, k_cache, v_cache, self.scale)
            x = ops.add_rms_norm(hidden, layer.o_proj(attn_out.reshape(-1, q_size), ctx), layer.post_attn_norm, eps)
            gate_up = layer.gate_up_proj(x, ctx)
            mlp_out = layer.down_proj(gate_up if layer.silu_in_gate_up else ops.silu_and_mul(gate_up), ctx)
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            x = ops.add_rms_norm(hidden, mlp_out, next_norm, eps)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
