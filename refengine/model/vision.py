"""The vision half of a LLaVA-style model: vision tower, feature selection, projector.

``VisionEncoder.encode(pixel_values)`` turns preprocessed images ``[n, 3, H, W]`` into the
language model's input embeddings ``[n, num_image_tokens, hidden]``, as
``LlavaForConditionalGeneration.get_image_features`` does: the tower's hidden states at
``vision_feature_layer`` (one layer, or several concatenated), without the CLS position
when ``vision_feature_select_strategy`` is "default", through the two-layer projector.

The tower itself is transformers' own module (CLIP or SigLIP vision model) built from the
checkpoint's ``vision_config`` with the checkpoint's weights: an image is encoded once per
request (or not at all, on an encoder-cache hit), so it is not on the step's hot path.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from refengine.config import ModelConfig
from refengine.model.manifest import UnsupportedModelError

TOWER_PREFIX, PROJECTOR_PREFIX = "vision_tower.", "multi_modal_projector."
ACTIVATIONS = {"gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu,
               "relu": F.relu}


@dataclass(frozen=True)
class VisionConfig:
    """What the engine needs to know of a model's vision path."""

    image_token_id: int
    num_image_tokens: int  # embedding positions one image fills in the prompt
    tower: dict[str, Any]  # the checkpoint's vision_config
    feature_layers: tuple[int, ...]
    drop_cls: bool  # vision_feature_select_strategy "default"
    projector_act: str


def load_vision_config(hf_dir: Path) -> VisionConfig | None:
    """The vision path of a LLaVA-style checkpoint; None for a text-only model."""
    config = json.loads((hf_dir / "config.json").read_text())
    if "vision_config" not in config:
        return None
    tower = config["vision_config"]
    layer = config.get("vision_feature_layer", -2)
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"{hf_dir}: vision_feature_select_strategy {strategy!r} is not supported")
    act = config.get("projector_hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ValueError(f"{hf_dir}: projector_hidden_act {act!r} is not supported")
    size, patch = tower.get("image_size"), tower.get("patch_size")
    if not (isinstance(size, int) and isinstance(patch, int) and 0 < patch <= size):  # a KeyError before
        raise UnsupportedModelError(f"{hf_dir}: vision_config needs integer image_size and patch_size "
                                    f"(patch_size at most image_size), got {size!r} and {patch!r}")
    patches = (size // patch) ** 2
    has_cls = tower.get("model_type", "clip_vision_model") == "clip_vision_model"
    return VisionConfig(
        image_token_id=config.get("image_token_index", config.get("image_token_id")),
        num_image_tokens=patches + int(has_cls) - int(strategy == "default"),
        tower=tower, feature_layers=tuple(layer) if isinstance(layer, list) else (layer,),
        drop_cls=strategy == "default", projector_act=act)


def _tower(config: dict[str, Any]) -> torch.nn.Module:
    from transformers import CLIPVisionConfig, CLIPVisionModel, SiglipVisionConfig, SiglipVisionModel

    kind = config.get("model_type", "clip_vision_model")
    if kind == "clip_vision_model":
        return CLIPVisionModel(CLIPVisionConfig(**config))
    if kind == "siglip_vision_model":
        return SiglipVisionModel(SiglipVisionConfig(**config))
    raise ValueError(f"vision tower {kind!r} is not supported (CLIP or SigLIP)")


VISION_PREFIXES = (TOWER_PREFIX, PROJECTOR_PREFIX)


def weights_digest(weights: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the vision tower's and projector's tensors: names, shapes, dtypes, bytes."""
    digest = hashlib.sha256()
    for name in sorted(n for n in weights if n.startswith(VISION_PREFIXES)):
        tensor = weights[name].detach().to("cpu").contiguous()
        digest.update(f"\0{name}\0{list(tensor.shape)}\0{tensor.dtype}\0".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _check_projector(projector: Mapping[str, torch.Tensor], tower_hidden: int, num_layers: int,
                     lm_hidden: int) -> None:
    """The projector maps the tower's selected features (its hidden size x the feature layers)
    through linear_1 and linear_2 to the LM's hidden size. Checked at load, naming the tensor: a
    mismatch would otherwise fail the first image request, not the start."""
    for name in ("linear_1.weight", "linear_2.weight"):
        if name not in projector or projector[name].dim() != 2:
            raise UnsupportedModelError(f"the weights lack {PROJECTOR_PREFIX}{name} (a matrix)")
    features = tower_hidden * num_layers
    inner = projector["linear_1.weight"].shape[0]
    expected = {"linear_1.weight": (inner, features), "linear_1.bias": (inner,),
                "linear_2.weight": (lm_hidden, inner), "linear_2.bias": (lm_hidden,)}
    for name, shape in expected.items():
        if name in projector and tuple(projector[name].shape) != shape:
            raise UnsupportedModelError(
                f"{PROJECTOR_PREFIX}{name} has shape {list(projector[name].shape)}, expected {list(shape)}: the "
                f"tower gives {features} features ({tower_hidden} x {num_layers} layer(s) selected), the LM takes "
                f"{lm_hidden}")


class VisionEncoder:
    def __init__(self, vision: VisionConfig, text: ModelConfig, weights: dict[str, torch.Tensor],
                 dtype: torch.dtype, device: str) -> None:
        self.config = vision
        tower = _tower(vision.tower)
        state = {name[len(TOWER_PREFIX):].removeprefix("vision_model."): w
                 for name, w in weights.items() if name.startswith(TOWER_PREFIX)}
        if any(name.startswith("vision_model.") for name in tower.state_dict()):  # a module tree with the wrapper
            state = {f"vision_model.{name}": w for name, w in state.items()}
        try:
            missing, unexpected = tower.load_state_dict(state, strict=False)
        except RuntimeError as exc:  # a tensor shaped other than vision_config implies
            detail = " ".join(str(exc).split())  # torch's message, on one line for the log
            raise UnsupportedModelError(f"vision tower weights do not match its config: {detail}") from None
        missing = [m for m in missing if not m.endswith("position_ids")]
        if missing or unexpected:
            raise UnsupportedModelError(f"vision tower weights do not match its config: missing {missing[:4]}, "
                                        f"unexpected {unexpected[:4]}")
        self.tower = tower.to(dtype=dtype, device=device).eval()
        projector = {name[len(PROJECTOR_PREFIX):]: w.to(dtype=dtype, device=device)
                     for name, w in weights.items() if name.startswith(PROJECTOR_PREFIX)}
        _check_projector(projector, tower.config.hidden_size, len(vision.feature_layers), text.hidden_size)
        self.linear_1 = (projector["linear_1.weight"], projector.get("linear_1.bias"))
        self.linear_2 = (projector["linear_2.weight"], projector.get("linear_2.bias"))
        self.dtype, self.device = dtype, device
        self.weights_digest = weights_digest(weights)

    def fingerprint(self, preprocessing: str, layout: str) -> str:
        """What makes two encoders' outputs interchangeable: the vision weights, the vision and
        preprocessing configuration (``preprocessing``: the image processor's JSON), dtype and
        row layout. Equal fingerprints = equal embeddings for equal media."""
        facts = {"weights": self.weights_digest, "vision": asdict(self.config), "preprocessing": preprocessing,
                 "dtype": str(self.dtype).removeprefix("torch."), "layout": layout}
        return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[n, 3, H, W]`` → ``[n, num_image_tokens, hidden]`` (the LM's dtype, on its device)."""
        out = self.tower(pixel_values.to(dtype=self.dtype, device=self.device), output_hidden_states=True)
        features = torch.cat([out.hidden_states[layer] for layer in self.config.feature_layers], dim=-1)
        if self.config.drop_cls:
            features = features[:, 1:]
        hidden = ACTIVATIONS[self.config.projector_act](F.linear(features, *self.linear_1))
        return F.linear(hidden, *self.linear_2)
