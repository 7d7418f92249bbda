"""Media in the engine: a request's images become runs of embedding positions in its prompt.

Before acceptance (``MediaInputs.prepare``, on the caller's thread): at most
``MediaConfig.max_items`` items, each decoded under the media policy
(``multimodal/sources.py``), the prompt's placeholders expanded (``multimodal/placeholders``),
and each image encoded — the image processor of the model directory (transformers'),
then the vision tower and projector (``model/vision.py``) — unless the encoder cache
already holds its identity. Any problem is an ``InvalidRequestError``; nothing is allocated.

Each step (``step_embeds``): for every scheduled sequence, the rows of its media runs that
fall in the step's token range replace those positions' token embeddings. A run may be
split across chunked-prefill steps: its embedding rows are computed whole before the
request is accepted, so any slice of them can go into any step (the LM's attention is
causal over positions, so a split computes exactly what one step would). The token budget
counts image positions like any others: they are prompt tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from refengine.config import MediaConfig, ModelConfig
from refengine.model.vision import VisionEncoder, load_vision_config
from refengine.multimodal.encoder_cache import EncoderCache
from refengine.multimodal.placeholders import expand_placeholders
from refengine.multimodal.sources import LoadedImage, load_image
from refengine.scheduler.scheduler import SchedulerOutput
from refengine.types import InvalidRequestError, MediaInput

if TYPE_CHECKING:
    from refengine.engine.request import Request

ENCODER_CACHE_ENTRIES = 256


@dataclass(frozen=True)
class MediaRun:
    """One media item placed in the prompt: positions ``start … start + len(embeds) - 1``."""

    start: int
    identity: str
    embeds: torch.Tensor  # [num_image_tokens, hidden], the LM's dtype and device

    @property
    def end(self) -> int:
        return self.start + self.embeds.shape[0]


class MediaInputs:
    def __init__(self, hf_dir: Path, encoder: VisionEncoder, config: MediaConfig) -> None:
        from transformers import AutoImageProcessor

        self.encoder = encoder
        self.config = config
        # backend "pil": the processor without torchvision (numpy and Pillow), which is what refengine installs
        self.image_processor = AutoImageProcessor.from_pretrained(hf_dir, local_files_only=True, backend="pil")
        self.cache: EncoderCache[torch.Tensor] = EncoderCache(ENCODER_CACHE_ENTRIES)
        self._encode_lock = threading.Lock()  # one encode at a time: the step thread runs the LM meanwhile

    @classmethod
    def from_model(cls, hf_dir: Path, text: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                   device: str, config: MediaConfig) -> MediaInputs | None:
        """The model's media path, or None for a text-only model."""
        vision = load_vision_config(hf_dir)
        if vision is None:
            return None
        return cls(hf_dir, VisionEncoder(vision, text, weights, dtype, device), config)

    def prepare(self, prompt_ids: Sequence[int], items: Sequence[MediaInput]) -> tuple[list[int], tuple[MediaRun, ...]]:
        """The expanded prompt and its media runs (see the module docstring)."""
        if len(items) > self.config.max_items:
            raise InvalidRequestError(f"{len(items)} media items; at most {self.config.max_items} per request")
        vision = self.encoder.config
        images = [load_image(item, self.config) for item in items]
        expanded, starts = expand_placeholders(prompt_ids, vision.image_token_id, len(images), vision.num_image_tokens)
        embeds = self._embeds(images)
        return expanded, tuple(MediaRun(start, image.identity, rows)
                               for start, image, rows in zip(starts, images, embeds, strict=True))

    def _embeds(self, images: list[LoadedImage]) -> list[torch.Tensor]:
        found = [self.cache.get(image.identity) for image in images]
        missing = [i for i, rows in enumerate(found) if rows is None]
        if missing:
            pixels = self.image_processor(images=[images[i].image for i in missing], return_tensors="pt")
            with self._encode_lock:
                encoded = self.encoder.encode(pixels["pixel_values"])
            for row, i in enumerate(missing):
                found[i] = encoded[row]
                self.cache.put(images[i].identity, encoded[row])
        return [rows for rows in found if rows is not None]


def step_embeds(sched: SchedulerOutput, requests: Mapping[str, Request]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The step rows that take media embeddings, and those embeddings; None when none does."""
    rows: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    step_start = 0
    for item in sched.scheduled:
        start, end = item.start, item.start + item.num_new_tokens
        for run in requests[item.request_id].media:
            first, last = max(start, run.start), min(end, run.end)
            if first < last:
                rows.append(torch.arange(step_start + first - start, step_start + last - start))
                values.append(run.embeds[first - run.start:last - run.start])
        step_start += item.num_new_tokens
    if not rows:
        return None
    return torch.cat(rows), torch.cat(values)
