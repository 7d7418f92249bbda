"""Every tensor the decoder reads, with the shape its ``config.json`` implies; checked at load.

A checkpoint whose tensors contradict its config must be refused at start, naming the
tensor: served anyway, it fails later and worse. A wrong ``head_dim`` sends the native
attention kernel past the end of its buffers (heap corruption, not an exception); a
``vocab_size`` smaller than the embedding silently samples from a truncated vocabulary;
a larger one fails every request. transformers refuses such checkpoints too.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from refengine.config import ModelConfig
from refengine.model.manifest import UnsupportedModelError

logger = logging.getLogger(__name__)

#: Names under these prefixes belong to the language model; anything else (a LLaVA vision tower,
#: its projector) is another component's to check (model/vision.py checks those at load).
LM_PREFIXES = ("model.", "lm_head.")


def lm_weight_shapes(config: ModelConfig, has_lm_head: bool) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every language-model tensor; ``lm_head.weight`` only when the head is its own."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_out = config.num_attention_heads * config.head_dim
    kv_out = config.num_key_value_heads * config.head_dim
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,)}
    if has_lm_head:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        shapes |= {
            f"model.layers.{i}.input_layernorm.weight": (hidden,),
            f"model.layers.{i}.post_attention_layernorm.weight": (hidden,),
            f"{attn}.q_proj.weight": (q_out, hidden), f"{attn}.k_proj.weight": (kv_out, hidden),
            f"{attn}.v_proj.weight": (kv_out, hidden), f"{attn}.o_proj.weight": (hidden, q_out),
            f"{mlp}.gate_proj.weight": (inter, hidden), f"{mlp}.up_proj.weight": (inter, hidden),
            f"{mlp}.down_proj.weight": (hidden, inter),
        }
        if config.attention_bias:
            shapes |= {f"{attn}.q_proj.bias": (q_out,), f"{attn}.k_proj.bias": (kv_out,),
                       f"{attn}.v_proj.bias": (kv_out,)}
    return shapes


def check_lm_weights(weights: dict[str, torch.Tensor], config: ModelConfig, hf_dir: Path) -> None:
    """Raise UnsupportedModelError when a tensor is missing or shaped other than the config says.

    Language-model tensors the decoder does not read (e.g. biases a Llama config does not
    declare, layers beyond ``num_hidden_layers``) are ignored with a warning, as transformers does.
    """
    last_layer = f"model.layers.{config.num_hidden_layers - 1}.input_layernorm.weight"
    if last_layer not in weights:  # before naming every layer's tensors: for 10**9 layers they fill the memory
        raise UnsupportedModelError(f"{hf_dir}: the weights lack {last_layer} "
                                    f"(config.json says num_hidden_layers={config.num_hidden_layers})")
    expected = lm_weight_shapes(config, "lm_head.weight" in weights)
    if missing := sorted(expected.keys() - weights.keys()):
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise UnsupportedModelError(f"{hf_dir}: the weights lack {', '.join(missing[:3])}{more}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise UnsupportedModelError(
                f"{hf_dir}: {name} has shape {list(weights[name].shape)} but config.json implies {list(shape)} "
                f"(vocab_size={config.vocab_size}, hidden_size={config.hidden_size}, "
                f"intermediate_size={config.intermediate_size}, num_attention_heads={config.num_attention_heads}, "
                f"num_key_value_heads={config.num_key_value_heads}, head_dim={config.head_dim})"
            )
    unread = sorted(n for n in weights.keys() - expected.keys() if n.startswith(LM_PREFIXES))
    if unread:
        logger.warning("%s: %d tensors are not used by the model, e.g. %s", hf_dir, len(unread), unread[0])
