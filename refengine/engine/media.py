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

Embedding handles (draft profile ``encoder``, ``multimodal/handles.py``): a request may carry
handles instead of items. They are checked before acceptance; their runs have no rows yet
(``embeds`` None) until the core pulls them (``media_pulls.py``). A decode engine never needs
the rows (it never computes the prompt), only each item's identity, so its runs stay empty:
for items it decodes the image to learn its identity, and never encodes it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from refengine.config import MediaConfig, ModelConfig
from refengine.model.embedding_io import dtype_name, embedding_layout
from refengine.model.manifest import UnsupportedModelError
from refengine.model.vision import VisionEncoder, load_vision_config
from refengine.multimodal.encoder_cache import EncoderCache
from refengine.multimodal.handles import HandleExpectation, check_handles
from refengine.multimodal.placeholders import expand_placeholders
from refengine.multimodal.sources import LoadedImage, check_item, fetched_bytes, image_of, local_bytes
from refengine.scheduler.scheduler import SchedulerOutput
from refengine.types import EmbeddingHandleSpec, InvalidRequestError, MediaInput

if TYPE_CHECKING:
    from refengine.engine.request import Request

ENCODER_CACHE_ENTRIES = 256
MEDIA_DECODES = 2  # requests decoding and encoding images at once (``MediaInputs.decoding``)
MEDIA_FETCHES = 4  # requests with media URLs holding fetched bodies at once (``MediaInputs.fetching``)


@dataclass(frozen=True)
class MediaRun:
    """One media item placed in the prompt: positions ``start … start + len(embeds) - 1``."""

    start: int
    identity: str
    num_tokens: int
    embeds: torch.Tensor | None  # [num_tokens, hidden], the LM's dtype and device; None: not here (yet)
    handle: EmbeddingHandleSpec | None = None  # where the rows are to be pulled from

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


class MediaInputs:
    def __init__(self, hf_dir: Path, encoder: VisionEncoder, config: MediaConfig) -> None:
        from transformers import AutoImageProcessor

        self.encoder = encoder
        self.config = config
        # backend "pil": the processor without torchvision (numpy and Pillow), which is what refengine installs
        # trust_remote_code=False: never a processor class from the model directory (``auto_map``), whose
        # code transformers would otherwise offer to run (asking on stdin when it has a terminal)
        try:
            self.image_processor = AutoImageProcessor.from_pretrained(hf_dir, local_files_only=True, backend="pil",
                                                                      trust_remote_code=False)
        except (OSError, ValueError) as exc:
            raise UnsupportedModelError(f"{hf_dir}: cannot load the image processor: {exc}") from exc
        self.cache: EncoderCache[torch.Tensor] = EncoderCache(ENCODER_CACHE_ENTRIES, config.encoder_cache_bytes,
                                                             lambda rows: rows.numel() * rows.element_size())
        self._encode_lock = threading.Lock()  # one encode at a time: the step thread runs the LM meanwhile
        # Requests whose images are between decoded and encoded at once: their pixels (up to
        # max_items x max_pixels x 3 bytes, and the processor's float copies) are what a burst of
        # image requests costs in memory; without a bound, 3 requests of 8 large PNGs took 2 GB.
        self.decoding = threading.BoundedSemaphore(MEDIA_DECODES)
        # Requests with URLs hold their fetched bodies (up to max_items x max_bytes) from the fetch
        # to the encode, waiting for a decode slot meanwhile; this bounds how many do (found by review:
        # 6 requests of 8 URLs held 48 bodies while no decode slot was free). Bytes that came with the
        # request are already in memory and take no fetch slot; a slow URL holds no decode slot.
        self.fetching = threading.BoundedSemaphore(MEDIA_FETCHES)
        self.expectation = self._expectation_of()

    @classmethod
    def from_model(cls, hf_dir: Path, text: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                   device: str, config: MediaConfig) -> MediaInputs | None:
        """The model's media path, or None for a text-only model."""
        vision = load_vision_config(hf_dir)
        if vision is None:
            return None
        return cls(hf_dir, VisionEncoder(vision, text, weights, dtype, device), config)

    def _expectation_of(self) -> HandleExpectation:
        """What a handle must match to stand in for this engine's own encoding."""
        hidden = self.encoder.linear_2[0].shape[0]
        layout = embedding_layout(hidden, self.encoder.dtype)
        return HandleExpectation(self.encoder.fingerprint(self.image_processor.to_json_string(), layout),
                                 self.encoder.config.num_image_tokens, hidden, dtype_name(self.encoder.dtype),
                                 layout)

    def check_placeholders(self, prompt_ids: Sequence[int]) -> None:
        """A request without media: its prompt must hold no image placeholder (InvalidRequestError)."""
        vision = self.encoder.config
        expand_placeholders(prompt_ids, vision.image_token_id, 0, vision.num_image_tokens)

    def prepare(self, prompt_ids: Sequence[int], items: Sequence[MediaInput],
                handles: Sequence[EmbeddingHandleSpec] = (), need_rows: bool = True,
                pull_backends: tuple[str, ...] | None = (), cache_salt: str | None = None,
                check_expanded: Callable[[list[int]], object] | None = None,
                ) -> tuple[list[int], tuple[MediaRun, ...]]:
        """The expanded prompt and its media runs (see the module docstring). ``need_rows``
        False: identities only (decode role: nothing encoded or pulled). ``pull_backends``: what
        handles may be pulled with. ``check_expanded`` judges the expanded prompt before any item
        is fetched, decoded or encoded (found by review: a prompt too long once expanded, or with
        an id past the vocabulary, was refused only after all of that)."""
        count = len(items) + len(handles)
        if items and handles:
            raise InvalidRequestError("a request carries media items or media handles, not both")
        if count > self.config.max_items:
            raise InvalidRequestError(f"{count} media items; at most {self.config.max_items} per request")
        vision = self.encoder.config
        expanded, starts = expand_placeholders(prompt_ids, vision.image_token_id, count, vision.num_image_tokens)
        if check_expanded is not None:
            check_expanded(expanded)
        if handles:
            check_handles(handles, self.expectation, pull_backends)
            return expanded, tuple(MediaRun(start, handle.identity, vision.num_image_tokens, None,
                                            handle if need_rows else None)
                                   for start, handle in zip(starts, handles, strict=True))
        with self.fetching if any(item.url for item in items) else contextlib.nullcontext():
            data = self.fetch(items)
            with self.decoding:
                images = self.decode(items, data)
                embeds = self._embeds(images, cache_salt) if need_rows else [None] * len(images)
        return expanded, tuple(MediaRun(start, image.identity, vision.num_image_tokens, rows)
                               for start, image, rows in zip(starts, images, embeds, strict=True))

    def fetch(self, items: Sequence[MediaInput]) -> list[bytes]:
        """Each item's encoded bytes (at most ``max_bytes``). Every item is checked as far as it
        can be without the network before any URL is fetched, so a bad item costs no download;
        network waits happen here, outside ``decoding``, so a slow URL holds no decode slot.
        A refusal names the item (``media item <index>: ...``)."""
        local: list[bytes | None] = []
        for index, item in enumerate(items):
            with _naming_item(index):
                check_item(item)
                local.append(local_bytes(item, self.config))
        data: list[bytes] = []
        for index, (item, item_data) in enumerate(zip(items, local, strict=True)):
            with _naming_item(index):
                data.append(item_data if item_data is not None else fetched_bytes(item, self.config))
        return data

    def decode(self, items: Sequence[MediaInput], data: Sequence[bytes]) -> list[LoadedImage]:
        """The images of ``fetch``'s bytes; call it holding ``decoding`` until they are encoded."""
        images: list[LoadedImage] = []
        for index, (item, item_data) in enumerate(zip(items, data, strict=True)):
            with _naming_item(index):
                images.append(image_of(item, item_data, self.config))
        return images

    def encode_images(self, images: Sequence[LoadedImage], wait: bool = True) -> torch.Tensor | None:
        """``[len(images), num_image_tokens, hidden]``: preprocess and encode, no cache. Without
        ``wait``, None when another encode is running (a health probe does not queue behind it)."""
        pixels = self.image_processor(images=[image.image for image in images], return_tensors="pt")
        if not self._encode_lock.acquire(blocking=wait):
            return None
        try:
            return self.encoder.encode(pixels["pixel_values"])
        finally:
            self._encode_lock.release()

    def _embeds(self, images: list[LoadedImage], cache_salt: str | None = None) -> list[torch.Tensor]:
        """Each image's rows, from the encoder cache where it holds them. A salted request's
        entries are its salt's alone (K2): a ``uuid`` is the client's name for an image, and
        another tenant naming a different image the same way got this one's rows. One identity is
        encoded once a request, from its first item: a ``uuid`` given to two different images
        names the first (as on an encoder, and as the prefix cache keys them; found by review:
        each was encoded, and the tokens differed from the same request sent through an encoder)."""
        keys = [salted(image.identity, cache_salt) for image in images]
        found = [self.cache.get(key) for key in keys]
        first_of: dict[str, int] = {}
        for i, rows in enumerate(found):
            if rows is None:
                first_of.setdefault(keys[i], i)
        if first_of:
            encoded = self.encode_images([images[i] for i in first_of.values()])
            rows_of = {}
            for row, key in enumerate(first_of):
                # a copy: a view of ``encoded`` would keep the whole batch alive as long as any one
                # of its entries stays cached (the cache bounds entries, not batches)
                rows_of[key] = encoded[row].clone() if len(first_of) > 1 else encoded[row]
                self.cache.put(key, rows_of[key])
            found = [rows_of[key] if rows is None else rows for key, rows in zip(keys, found, strict=True)]
        return found


def salted(identity: str, cache_salt: str | None) -> str:
    """The encoder-cache key of an image: its identity, within ``cache_salt`` when one is given.
    One-to-one: the salt comes first, length-prefixed, and an unsalted identity starts with
    ``uuid:`` or ``sha256:``, never ``salt``. (Found by review: ``identity + "\\0salt:" + salt``
    let an unsalted uuid ``"u\\0salt:a"`` name tenant ``a``'s entry for uuid ``"u"``, reading its
    embeddings or, sent first, poisoning them.)"""
    return f"salt{len(cache_salt)}:{cache_salt}|{identity}" if cache_salt else identity


@contextlib.contextmanager
def _naming_item(index: int) -> Iterator[None]:
    """An ``InvalidRequestError`` raised inside says which of the request's items it is about."""
    try:
        yield
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"media item {index}: {exc}") from None


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
                assert run.embeds is not None, "a run is scheduled only once its rows are here"
                rows.append(torch.arange(step_start + first - start, step_start + last - start))
                values.append(run.embeds[first - run.start:last - run.start])
        step_start += item.num_new_tokens
    if not rows:
        return None
    return torch.cat(rows), torch.cat(values)
