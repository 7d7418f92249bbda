"""Random LoRA adapters in PEFT's saved layout, for a model described by its Hugging Face
``config.json``: what the suite's LoRA checks load into the server under test (and what the
benchmarks load). numpy and ``safetensors.numpy`` only — the suite never imports torch.

Layout (what ``peft``'s ``save_pretrained`` writes): ``adapter_config.json`` and
``adapter_model.safetensors`` with ``base_model.model.model.layers.<i>.<block>.<module>
.lora_A.weight`` ``[r, in]`` and ``.lora_B.weight`` ``[out, r]`` for each targeted module.
Weights are seeded normal values: ``A`` with standard deviation ``1 / sqrt(in)`` (so ``A x``
keeps the scale of ``x``), ``B`` with ``b_std``, ``lora_alpha = r`` (scale 1). At the default
0.3, a rank-8 q/v adapter changes SmolLM2's greedy output within a few tokens and its
output stays text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class ModelShape:
    """The projection sizes of a Llama-family model."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int

    @classmethod
    def from_model_config_json(cls, path: str | Path) -> ModelShape:
        config = json.loads(Path(path).read_text())
        heads = config["num_attention_heads"]
        return cls(config["hidden_size"], config["intermediate_size"], heads,
                   config.get("num_key_value_heads") or heads,
                   config.get("head_dim") or config["hidden_size"] // heads, config["num_hidden_layers"])

    def in_out(self, module: str) -> tuple[int, int]:
        q_out, kv_out = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        hidden, inter = self.hidden_size, self.intermediate_size
        return {"q_proj": (hidden, q_out), "k_proj": (hidden, kv_out), "v_proj": (hidden, kv_out),
                "o_proj": (q_out, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
                "down_proj": (inter, hidden)}[module]


def write_random_adapter(directory: str | Path, shape: ModelShape, rank: int = 8,
                         modules: tuple[str, ...] = ("q_proj", "v_proj"), seed: int = 0, b_std: float = 0.3) -> Path:
    """Write a rank-``rank`` adapter on ``modules`` of every layer into ``directory`` (made)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(shape.num_hidden_layers):
        for module in modules:
            block = "self_attn" if module in ATTENTION else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            in_features, out_features = shape.in_out(module)
            lora_a = rng.standard_normal((rank, in_features)) / np.sqrt(in_features)
            tensors[f"{key}.lora_A.weight"] = lora_a.astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((out_features, rank)) * b_std).astype(np.float32)
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(target / "adapter_model.safetensors"), metadata={"format": "pt"})
    (target / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
        "target_modules": list(modules), "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False}))
    return target
