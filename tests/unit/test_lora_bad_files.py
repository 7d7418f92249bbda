"""Adapter files that are malformed in ways the first checks missed (found by review): each is
refused with ``InvalidRequestError`` (INVALID_ARGUMENT), never an exception the server reports
as INTERNAL, and nothing non-finite is kept."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from refengine.config import LoraConfig, ModelConfig
from refengine.conformance.lora_files import ModelShape, write_random_adapter
from refengine.lora.registry import LoraRegistry
from refengine.types import InvalidRequestError, LoraAdapterSpec
from tests.tiny_models import make_tiny_hf_model, model_config_from_hf


@pytest.fixture(scope="module")
def model_config() -> ModelConfig:
    return model_config_from_hf(make_tiny_hf_model(vocab_size=300, max_position_embeddings=64))


def adapter(root: Path, config: ModelConfig) -> Path:
    shape = ModelShape(config.hidden_size, config.intermediate_size, config.num_attention_heads,
                       config.num_key_value_heads, config.head_dim, config.num_hidden_layers)
    return write_random_adapter(root / "a", shape, rank=4)


def refused(root: Path, config: ModelConfig, directory: Path) -> str:
    registry = LoraRegistry(LoraConfig(enabled=True, roots=(str(root),)), config)
    with pytest.raises(InvalidRequestError) as refusal:
        registry.load(LoraAdapterSpec(1, "a", str(directory)))
    return str(refusal.value)


@pytest.mark.parametrize("digits,why", [(5000, "not valid JSON"), (400, "lora_alpha must be a finite number")])
def test_an_integer_too_long_for_json_or_float_is_refused(model_config: ModelConfig, tmp_path: Path,
                                                          digits: int, why: str) -> None:
    """5,000 digits: past Python's int-parsing limit (ValueError); 400: past float's range
    (OverflowError in the finiteness check)."""
    root = Path(os.path.realpath(tmp_path))
    directory = adapter(root, model_config)
    config = json.loads((directory / "adapter_config.json").read_text())
    text = json.dumps({**config, "lora_alpha": 0}).replace('"lora_alpha": 0', '"lora_alpha": ' + "9" * digits)
    (directory / "adapter_config.json").write_text(text)
    assert why in refused(root, model_config, directory)


@pytest.mark.parametrize("field", ["rank_pattern", "target_modules"])
def test_a_deeply_nested_pattern_is_refused(model_config: ModelConfig, tmp_path: Path, field: str) -> None:
    """The regex compiler recurses once per group: 2,000 nested groups raised RecursionError."""
    root = Path(os.path.realpath(tmp_path))
    directory = adapter(root, model_config)
    config = json.loads((directory / "adapter_config.json").read_text())
    pattern = "(" * 2000 + "q_proj" + ")" * 2000
    config[field] = {pattern: 4} if field == "rank_pattern" else pattern
    (directory / "adapter_config.json").write_text(json.dumps(config))
    refused(root, model_config, directory)


def test_a_float64_lora_a_past_float32s_range_is_refused(model_config: ModelConfig, tmp_path: Path) -> None:
    """1e300 is finite in float64, infinite in the float32 kept: the check ran before the cast."""
    root = Path(os.path.realpath(tmp_path))
    directory = adapter(root, model_config)
    weights = directory / "adapter_model.safetensors"
    tensors = {name: value.astype(np.float64) for name, value in load_file(str(weights)).items()}
    tensors[next(name for name in sorted(tensors) if name.endswith("lora_A.weight"))][0, 0] = 1e300
    save_file(tensors, str(weights))
    assert "NaN or infinity" in refused(root, model_config, directory)


@pytest.mark.parametrize("name", ["adapter_model.safetensors", "adapter_config.json"])
def test_a_fifo_in_place_of_an_adapter_file_is_named_as_such(model_config: ModelConfig, tmp_path: Path,
                                                             name: str) -> None:
    """Refused without opening it (a FIFO's open would wait for a writer), and said so: the message
    said the file was missing (found by a review probe)."""
    root = Path(os.path.realpath(tmp_path))
    directory = adapter(root, model_config)
    (directory / name).unlink()
    os.mkfifo(directory / name)
    assert f"{name} is not a regular file" in refused(root, model_config, directory)
