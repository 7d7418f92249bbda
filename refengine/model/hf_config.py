"""``config.json`` (and ``generation_config.json``) of a Hugging Face directory -> ModelConfig.

Anything malformed -- invalid JSON, a missing or mistyped field, values ModelConfig refuses --
raises UnsupportedModelError naming the file and the field, never a bare KeyError.
A key the file omits takes the default of transformers' config class for its model type, as
transformers does when it loads the same file (``_transformers_defaults``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from refengine.config import ModelConfig
from refengine.model.manifest import UnsupportedModelError

logger = logging.getLogger(__name__)

#: Hugging Face architectures refengine implements, with their ``model_type``.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "LlavaForConditionalGeneration": "llava",  # a vision tower + projector before a Llama-family LM
}


#: Omitted keys refengine does not take from transformers' defaults: special-token ids come from
#: the files (a default eos of 2 would stop on an arbitrary token of another vocabulary).
_NOT_DEFAULTED = frozenset({"bos_token_id", "eos_token_id", "pad_token_id"})


def _transformers_defaults(model_type: str) -> dict[str, Any]:
    """The value transformers' config class for ``model_type`` gives a key the file omits: its
    declared field defaults (e.g. Mistral's ``sliding_window`` 4096, Llama's 4096 hidden size for
    a LLaVA text_config saved as a diff). Fields declared None are derived from others in
    ``__post_init__`` (head_dim, num_key_value_heads, rope_parameters) and stay this module's job."""
    from transformers import CONFIG_MAPPING  # the class only: no remote code, no network

    return {f.name: f.default for f in dataclasses.fields(CONFIG_MAPPING[model_type])
            if isinstance(f.default, bool | int | float | str) and f.name not in _NOT_DEFAULTED}


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; UnsupportedModelError naming the file when it is not one."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UnsupportedModelError(f"{path} is not valid UTF-8 JSON: {exc}") from exc
    except OSError as exc:  # e.g. a directory where the file should be
        raise UnsupportedModelError(f"cannot read {path}: {exc}") from exc
    if not isinstance(value, dict):
        raise UnsupportedModelError(f"{path} must hold a JSON object, not {type(value).__name__}")
    return value


def _token_ids(value: int | list[int] | None) -> list[int]:
    """config files store special-token ids as an int, a list, or null."""
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _rope(config: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either config layout.

    transformers >= 5 writes ``rope_parameters`` (theta inside); older files have
    ``rope_theta`` plus ``rope_scaling`` (``type`` in the oldest). ``rope_scaling`` is
    returned without theta, and only for a non-default kind (llama3 is the one we run).
    llama3's ``original_max_position_embeddings`` follows transformers' precedence: a
    top-level one wins, then the one inside, else ``max_position_embeddings``.
    """
    # transformers: ``rope_parameters = rope_scaling or rope_parameters`` (convert_rope_params_to_dict)
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    theta = next((t for t in (params.pop("rope_theta", None), config.get("rope_theta")) if t is not None), 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise UnsupportedModelError(f"RoPE scaling {rope_type!r} is not implemented (only 'llama3')")
    if config.get("original_max_position_embeddings") is not None:
        params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    else:
        params.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    return float(theta), {"rope_type": rope_type, **params}


def load_model_config(hf_dir: Path) -> ModelConfig:
    """Parse ``config.json`` (and ``generation_config.json`` for stop ids) into a ModelConfig.

    Raises UnsupportedModelError (naming config.json) for a file it cannot serve.
    """
    try:
        return _parse_model_config(hf_dir)
    except UnsupportedModelError:
        raise
    except KeyError as exc:
        raise UnsupportedModelError(f"{hf_dir / 'config.json'}: required field {exc} is missing") from exc
    except (TypeError, ValueError, AttributeError, ArithmeticError) as exc:  # a field's type or value
        raise UnsupportedModelError(f"{hf_dir / 'config.json'}: {exc}") from exc


def _parse_model_config(hf_dir: Path) -> ModelConfig:
    """load_model_config's work; a missing or mistyped field surfaces as KeyError/TypeError/ValueError.

    Qwen2 has q/k/v biases by architecture (its config has no flag for it). A sliding
    window (Mistral v0.1) is not implemented, so the context is capped at the window,
    where full attention computes exactly the same thing.
    """
    config = read_json(hf_dir / "config.json")
    gen_path = hf_dir / "generation_config.json"
    generation = read_json(gen_path) if gen_path.is_file() else {}
    by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
    architecture = (config.get("architectures") or [None])[0] or by_type.get(config.get("model_type", ""))
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{hf_dir}: architecture {architecture!r} is not supported ({', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    model_type = SUPPORTED_ARCHITECTURES[architecture]
    if model_type == "llava":  # the LM's own config; the vision part is model/vision.py's
        text_config = config["text_config"]
        model_type = text_config.get("model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2"):
            raise UnsupportedModelError(f"{hf_dir}: a {model_type!r} language model is not supported")
        # LlavaConfig.__post_init__: tied when the outer config or the text config says so
        tied = bool(config.get("tie_word_embeddings")) or bool(text_config.get("tie_word_embeddings"))
        quantization = config.get("quantization_config")
        config = {**_transformers_defaults(model_type), "eos_token_id": config.get("eos_token_id"),
                  **text_config, "tie_word_embeddings": tied}
        if quantization:
            config["quantization_config"] = quantization
    else:
        config = {**_transformers_defaults(model_type), **config}
    if quantization := config.get("quantization_config"):
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise UnsupportedModelError(f"{hf_dir}: quantized checkpoints (quantization_config {method!r}) are not "
                                    "supported; serve the unquantized weights")
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{hf_dir}: activation {config['hidden_act']!r} is not supported")
    if model_type != "qwen2" and (config.get("attention_bias") or config.get("mlp_bias")):
        raise UnsupportedModelError(
            f"{hf_dir}: o_proj/MLP biases (attention_bias/mlp_bias) are not supported"
        )

    rope_theta, rope_scaling = _rope(config)
    max_positions = config["max_position_embeddings"]
    window = config.get("sliding_window")
    if window and (model_type == "mistral" or config.get("use_sliding_window")) and window < max_positions:
        logger.warning("%s: sliding window %d not implemented; context capped at it", hf_dir, window)
        max_positions = window
    heads = config["num_attention_heads"]
    eos = _token_ids(config.get("eos_token_id")) + _token_ids(generation.get("eos_token_id"))
    if outside := [t for t in eos if isinstance(t, int) and t >= config["vocab_size"]]:  # never sampled
        logger.warning("%s: EOS token ids %s are outside the vocabulary (%d); ignored", hf_dir, outside,
                       config["vocab_size"])
        eos = [t for t in eos if t not in outside]
    bos = config.get("bos_token_id") if config.get("bos_token_id") is not None else generation.get("bos_token_id")
    if isinstance(bos, int) and bos >= config["vocab_size"]:  # the health probe's prompt: refused as a request
        logger.warning("%s: BOS token id %d is outside the vocabulary (%d); ignored", hf_dir, bos, config["vocab_size"])
        bos = None
    return ModelConfig(
        architecture=architecture,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2",
        bos_token_id=bos,
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )


