"""From a model name or path to a config, weights and a tokenizer.

Every model is served from a Hugging Face-style directory: ``config.json``,
``*.safetensors`` (one file, or shards listed in ``model.safetensors.index.json``),
``tokenizer.json`` + ``tokenizer_config.json`` (with the chat template), and an
optional ``generation_config.json``. A GGUF is first converted into such a directory
in the cache (see ``gguf_convert``), so everything below reads one format.

Weights are safetensors only: a pickle checkpoint (``pytorch_model.bin``) is refused,
because loading one can run arbitrary code.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from refengine.config import ModelConfig, default_cache_dir
from refengine.model.gguf_convert import ensure_converted, source_fingerprint
from refengine.model.manifest import (
    Manifest,
    ModelNotFoundError,
    UnsupportedModelError,
    hf_dir_missing,
    load_manifest,
    locate_gguf,
    locate_local_dir,
    manifest_names,
    refuse_pickle_only,
    unknown_name_error,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

#: Hugging Face architectures refengine implements, with their ``model_type``.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "LlavaForConditionalGeneration": "llava",  # a vision tower + projector before a Llama-family LM
}
#: LLaVA checkpoints name the LM's tensors under a prefix (two spellings: the original one,
#: and transformers 5's module tree); loaded, they are renamed to the plain LM's names.
LLAVA_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."), ("model.vision_tower.", "vision_tower."),
                  ("model.multi_modal_projector.", "multi_modal_projector."))


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready to load: ``path`` is a complete Hugging Face directory.

    ``name`` is the served model name (the manifest name, or the directory/file stem);
    ``manifest`` is ``None`` when the model was given as a path.
    """

    name: str
    path: Path
    manifest: Manifest | None = None


def resolve_model(name_or_path: str, cache_dir: Path | None = None) -> ResolvedModel:
    """Turn a manifest name, a Hugging Face directory or a ``.gguf`` file into a ResolvedModel.

    A bare word that names a manifest always means the manifest (whatever the current
    directory holds). A GGUF is converted once into ``<cache_dir>/models/<name>``;
    ``cache_dir`` defaults to ``$REFENGINE_CACHE_DIR`` or ``~/.cache/refengine``.
    Raises ModelNotFoundError (what to put where) or UnsupportedModelError.
    """
    models_cache = (cache_dir or default_cache_dir()) / "models"
    is_bare_name = "/" not in name_or_path and not name_or_path.endswith(".gguf")
    if is_bare_name and name_or_path in manifest_names():
        manifest = load_manifest(name_or_path)
        if manifest.source.kind == "gguf_package":
            path = ensure_converted(locate_gguf(manifest), models_cache / manifest.name)
        else:
            path = locate_local_dir(manifest)
        _warn_on_architecture_mismatch(manifest, path)
        return ResolvedModel(name=manifest.name, path=path, manifest=manifest)

    path = Path(name_or_path).expanduser().resolve()
    if path.is_file() and path.suffix == ".gguf":
        target = models_cache / f"{path.stem}-{source_fingerprint(path)[:12]}"
        return ResolvedModel(name=path.stem, path=ensure_converted(path, target))
    if path.is_dir():
        refuse_pickle_only(path)
        missing = hf_dir_missing(path)
        if missing:
            raise ModelNotFoundError(
                f"{path} is not a complete Hugging Face model directory: missing {', '.join(missing)}"
            )
        return ResolvedModel(name=path.name, path=path)
    if path.exists():
        raise ModelNotFoundError(f"{path} is neither a Hugging Face model directory nor a .gguf file")
    raise unknown_name_error(name_or_path)


def _warn_on_architecture_mismatch(manifest: Manifest, path: Path) -> None:
    """A directory pointed at by an env var may hold another model than the manifest says."""
    found = (_read_json(path / "config.json").get("architectures") or [None])[0]
    if found != manifest.architecture:
        logger.warning("%s: manifest says %s, %s holds %s", manifest.name, manifest.architecture, path, found)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


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
    """
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or config.get("rope_theta") or 10000.0
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise UnsupportedModelError(f"RoPE scaling {rope_type!r} is not implemented (only 'llama3')")
    return float(theta), {"rope_type": rope_type, **params}


def load_model_config(hf_dir: Path) -> ModelConfig:
    """Parse ``config.json`` (and ``generation_config.json`` for stop ids) into a ModelConfig.

    Qwen2 has q/k/v biases by architecture (its config has no flag for it). A sliding
    window (Mistral v0.1) is not implemented, so the context is capped at the window,
    where full attention computes exactly the same thing.
    """
    config = _read_json(hf_dir / "config.json")
    gen_path = hf_dir / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.is_file() else {}
    by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
    architecture = (config.get("architectures") or [None])[0] or by_type.get(config.get("model_type", ""))
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{hf_dir}: architecture {architecture!r} is not supported ({', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    model_type = SUPPORTED_ARCHITECTURES[architecture]
    if model_type == "llava":  # the LM's own config; the vision part is model/vision.py's
        config = {"eos_token_id": config.get("eos_token_id"),
                  "tie_word_embeddings": config.get("tie_word_embeddings", False), **config["text_config"]}
        model_type = config.get("model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2"):
            raise UnsupportedModelError(f"{hf_dir}: a {model_type!r} language model is not supported")
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
    bos = config.get("bos_token_id")
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
        bos_token_id=bos if bos is not None else generation.get("bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )


def weight_files(hf_dir: Path) -> list[Path]:
    """The safetensors files holding the weights: the index's shards, else model.safetensors,
    else every ``*.safetensors`` except Mistral's duplicate ``consolidated*`` format."""
    refuse_pickle_only(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(_read_json(index)["weight_map"].values()))
    elif (hf_dir / "model.safetensors").is_file():
        names = ["model.safetensors"]
    else:
        names = sorted(p.name for p in hf_dir.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if not names:
        raise ModelNotFoundError(f"{hf_dir} has no *.safetensors weights")
    return [hf_dir / name for name in names]


def load_weights(hf_dir: Path, dtype: torch.dtype = torch.float32,
                 prefixes: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """All parameters by Hugging Face name (``model.layers.0.self_attn.q_proj.weight``), on CPU;
    with ``prefixes``, only those whose name starts with one (the rest is never read).

    Normalized so consumers see one shape of dict: ``lm_head.weight`` is present iff the
    embeddings are not tied (a tied copy some files carry is dropped), and saved
    ``rotary_emb.inv_freq`` buffers (computed, not learned) are skipped.
    """
    config = _read_json(hf_dir / "config.json")
    tied = bool(config.get("text_config", config).get("tie_word_embeddings", config.get("tie_word_embeddings")))
    llava = "vision_config" in config
    weights: dict[str, torch.Tensor] = {}
    for path in weight_files(hf_dir):
        with safe_open(path, framework="pt") as f:
            for stored in f.keys():
                if stored.endswith("rotary_emb.inv_freq"):
                    continue
                name = _llava_name(stored) if llava else stored
                if prefixes is not None and not name.startswith(prefixes):
                    continue
                if name in weights:
                    raise UnsupportedModelError(f"{hf_dir}: tensor {name} appears in two weight files")
                weights[name] = f.get_tensor(stored).to(dtype)
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        expected = {_llava_name(n) if llava else n for n in _read_json(index)["weight_map"]
                    if not n.endswith("rotary_emb.inv_freq")}
        expected = {n for n in expected if prefixes is None or n.startswith(prefixes)}
        if missing := expected - weights.keys():
            raise UnsupportedModelError(f"{hf_dir}: shards lack {sorted(missing)[:5]} listed in the index")
    if prefixes is not None:
        return weights
    if tied:
        weights.pop("lm_head.weight", None)
    elif "lm_head.weight" not in weights:
        raise UnsupportedModelError(f"{hf_dir}: no lm_head.weight and tie_word_embeddings is false")
    return weights


def _llava_name(stored: str) -> str:
    for prefix, plain in LLAVA_PREFIXES:
        if stored.startswith(prefix):
            return plain + stored[len(prefix):]
    return stored


def load_tokenizer(hf_dir: Path) -> PreTrainedTokenizerFast:
    """The fast (Rust) tokenizer of ``hf_dir``, chat template included; never downloads."""
    missing = [n for n in ("tokenizer.json", "tokenizer_config.json") if not (hf_dir / n).is_file()]
    if missing:
        raise ModelNotFoundError(f"{hf_dir} lacks {', '.join(missing)} (refengine needs a fast tokenizer)")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise UnsupportedModelError(f"{hf_dir}: {type(tokenizer).__name__} is not a fast tokenizer")
    return tokenizer


def model_fingerprint(hf_dir: Path) -> str:
    """A stable identity of the weights, for prefix-cache keys: equal fingerprints => equal KV.

    Hashes the canonical config plus each weight file's name and size (not the contents,
    which would take seconds per start); the directory's location does not count.
    """
    config = _read_json(hf_dir / "config.json")
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for path in weight_files(hf_dir):
        digest.update(f"\0{path.name}\0{path.stat().st_size}".encode())
    return digest.hexdigest()[:32]
