"""Model configs and weight loading as transformers reads them (found by a review, 2026-12-06):
quantized checkpoints refused (an FP8 one loaded without its scales: garbage, no error),
``rope_scaling`` before ``rope_parameters``, LLaVA's outer ``tie_word_embeddings``, a tied
checkpoint storing only ``lm_head.weight``, ``model.safetensors`` before an index. Each test
states what transformers does, and checks it against transformers where it can."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, Qwen2Config

from refengine.model import ModelNotFoundError, UnsupportedModelError, load_model_config, load_weights
from tests.unit.test_loader import VOCAB, save_model, save_tiny_tokenizer, tiny_model


def test_fp8_quantized_checkpoint_is_refused(tmp_path: Path) -> None:
    """An FP8 checkpoint (float8_e4m3fn weights + weight_scale, quantization_config in config.json, the
    layout of compressed-tensors / HF fp8 Llama/Qwen2 checkpoints) must be refused: cast to float32
    without its scales every projection is ~1/scale times too large -> garbage tokens, no error."""
    d = save_model(tiny_model("llama"), tmp_path / "fp8")
    state = load_file(d / "model.safetensors")
    out = {}
    for name, w in state.items():
        if name.endswith("proj.weight"):
            scale = w.abs().max() / 448.0
            out[name] = (w / scale).to(torch.float8_e4m3fn)
            out[name.replace(".weight", ".weight_scale")] = scale.reshape(1)
        else:
            out[name] = w
    save_file(out, d / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError):
        load_model_config(d)
        load_weights(d)


def test_integer_weights_are_refused(tmp_path: Path) -> None:
    d = save_model(tiny_model("llama"), tmp_path / "int8")
    state = load_file(d / "model.safetensors")
    state["model.layers.0.mlp.down_proj.weight"] = (state["model.layers.0.mlp.down_proj.weight"] * 100).to(torch.int8)
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError):
        load_weights(d)


def test_rope_scaling_wins_over_rope_parameters_as_in_transformers(tmp_path: Path) -> None:
    """transformers: ``self.rope_parameters = rope_scaling or self.rope_parameters`` (modeling_rope_utils
    convert_rope_params_to_dict). A config holding both keys gets llama3 scaling in transformers."""
    d = save_model(tiny_model(), tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    (d / "config.json").write_text(json.dumps(config))
    want = transformers.AutoConfig.from_pretrained(d).rope_parameters
    got = load_model_config(d)
    assert (got.rope_theta, (got.rope_scaling or {}).get("rope_type")) == (want["rope_theta"], want["rope_type"])


def test_llava_outer_tie_word_embeddings_wins_as_in_transformers(tmp_path: Path) -> None:
    """LlavaConfig.__post_init__: tie = outer or text_config's. transformers saves this checkpoint
    itself (no lm_head.weight) and loads it tied; refengine refuses it."""
    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                              image_size=56, patch_size=14, projection_dim=32)
    text = Qwen2Config(vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       eos_token_id=2, tie_word_embeddings=False)
    model = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text,
                                                      image_token_index=len(VOCAB) - 1, tie_word_embeddings=True))
    model.save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path)
    assert model.lm_head.weight is model.get_input_embeddings().weight  # transformers ties
    assert load_model_config(tmp_path).tie_word_embeddings
    load_weights(tmp_path)


def test_tied_checkpoint_storing_only_lm_head_loads_as_in_transformers(tmp_path: Path) -> None:
    """transformers' tie_weights swaps source/target when only the head is stored."""
    model = tiny_model(tie=True)
    d = save_model(model, tmp_path / "m")
    state = load_file(d / "model.safetensors")
    state["lm_head.weight"] = state.pop("model.embed_tokens.weight")
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})
    assert torch.equal(transformers.AutoModelForCausalLM.from_pretrained(d).model.embed_tokens.weight,
                       model.model.embed_tokens.weight)
    assert torch.equal(load_weights(d)["model.embed_tokens.weight"], model.model.embed_tokens.weight)


def test_model_safetensors_is_preferred_over_an_index_as_in_transformers(tmp_path: Path) -> None:
    """transformers' _get_resolved_checkpoint_files looks for model.safetensors before the index."""
    old, new = tiny_model(), tiny_model()
    with torch.no_grad():
        new.model.norm.weight.add_(1.0)
    d = save_model(old, tmp_path / "m", max_shard_size="20KB")
    new_dir = save_model(new, tmp_path / "new")
    (d / "model.safetensors").write_bytes((new_dir / "model.safetensors").read_bytes())
    want = transformers.AutoModelForCausalLM.from_pretrained(d).model.norm.weight
    assert torch.equal(load_weights(d)["model.norm.weight"], want)


def test_a_directory_of_mistral_consolidated_weights_only_says_so(tmp_path: Path) -> None:
    """Its consolidated*.safetensors passed the directory check and then read as 'no *.safetensors
    weights' (found by review): the error names the format it holds."""
    d = save_model(tiny_model(), tmp_path / "m")
    (d / "model.safetensors").rename(d / "consolidated.safetensors")
    with pytest.raises(ModelNotFoundError, match="only Mistral's own consolidated"):
        load_weights(d)


@pytest.mark.parametrize("vision_config", [{"patch_size": 14}, {"image_size": 56}, {"image_size": 56, "patch_size": 0}])
def test_a_vision_config_without_its_sizes_is_refused_naming_them(tmp_path: Path, vision_config: dict) -> None:
    from refengine.model.vision import load_vision_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "vision_config": vision_config}))
    with pytest.raises(UnsupportedModelError, match="image_size and patch_size"):
        load_vision_config(tmp_path)
