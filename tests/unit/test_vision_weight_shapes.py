"""A LLaVA checkpoint whose vision weights contradict its config is refused at load, naming the
tensor (as ``weight_shapes`` does for the language model), instead of failing the first image
request. The oracle: the tiny LLaVA that transformers builds and saves, then broken one way each."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from refengine.config import MediaConfig
from refengine.engine.media import MediaInputs
from refengine.model.loader import load_model_config, load_weights
from refengine.model.manifest import UnsupportedModelError
from tests import tiny_llava

PROJECTOR, TOWER = "multi_modal_projector.", "vision_tower.vision_model."


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llava.build_tiny_llava(tmp_path_factory.mktemp("llava")).directory


def _load(directory: Path) -> MediaInputs | None:
    weights = load_weights(directory)
    return MediaInputs.from_model(directory, load_model_config(directory), weights, torch.float32, "cpu",
                                  MediaConfig())


def _edit_tensors(directory: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    for path in directory.glob("*.safetensors"):
        tensors = load_file(path)
        edit(tensors)
        save_file(tensors, path)


def _key(tensors: dict[str, torch.Tensor], suffix: str) -> str:
    """The stored name ending in ``suffix`` (transformers' LLaVA names vary across versions)."""
    return next(name for name in tensors if name.endswith(suffix))


def _reshape(suffix: str, shape: tuple[int, ...]) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[_key(tensors, suffix)] = torch.zeros(shape)
    return edit


def _drop(suffix: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        del tensors[_key(tensors, suffix)]
    return edit


def test_the_unbroken_checkpoint_loads(checkpoint: Path) -> None:
    assert _load(checkpoint) is not None


# The tiny model: CLIP hidden 32, projector 32 -> 64 -> 64 (the LM's hidden size).
@pytest.mark.parametrize(("edit", "message"), [
    (_reshape(PROJECTOR + "linear_1.weight", (64, 48)),
     r"linear_1.weight has shape \[64, 48\], expected \[64, 32\]: the tower gives 32 features"),
    (_reshape(PROJECTOR + "linear_2.weight", (40, 64)), r"linear_2.weight has shape \[40, 64\], expected \[64, 64\]"),
    (_reshape(PROJECTOR + "linear_1.bias", (63,)), r"linear_1.bias has shape \[63\], expected \[64\]"),
    (_drop(PROJECTOR + "linear_2.weight"), r"the weights lack multi_modal_projector.linear_2.weight"),
    (_reshape("encoder.layers.0.self_attn.q_proj.weight", (32, 16)), r"vision tower weights do not match.*q_proj"),
    (_drop("encoder.layers.1.mlp.fc1.weight"), r"vision tower weights do not match.*missing.*fc1"),
], ids=["linear_1-input", "linear_2-output", "bias", "missing-projector", "tower-shape", "missing-tower-tensor"])
def test_a_contradicting_tensor_is_refused_at_load_naming_it(checkpoint: Path, tmp_path: Path, edit,
                                                             message: str) -> None:  # noqa: ANN001
    broken = Path(shutil.copytree(checkpoint, tmp_path / "broken"))
    _edit_tensors(broken, edit)
    with pytest.raises(UnsupportedModelError, match=message):
        _load(broken)


def test_two_feature_layers_need_a_projector_twice_as_wide(checkpoint: Path, tmp_path: Path) -> None:
    """vision_feature_layer [-2, -1] concatenates two layers' features: 64 projector inputs, not 32."""
    broken = Path(shutil.copytree(checkpoint, tmp_path / "two-layers"))
    config = json.loads((broken / "config.json").read_text())
    config["vision_feature_layer"] = [-2, -1]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"expected \[64, 64\]: the tower gives 64 features \(32 x 2"):
        _load(broken)
