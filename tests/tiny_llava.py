"""A tiny random LLaVA checkpoint for the multimodal tests, built offline with transformers.

:func:`build_tiny_llava` makes the model (a CLIP vision tower of 56 px images in 14 px
patches → 16 image positions once the CLS is dropped, then a 2-layer Llama LM; seeded
random weights) and saves it into a directory with its ``CLIPImageProcessor`` and a fast
tokenizer (``tests/unit/tokenizer_fixture.byte_fallback_tokenizer``), so both
``MediaInputs.from_model`` and ``refengine serve --model DIR`` load it like any checkpoint.
The image placeholder is the last vocabulary id (:data:`IMAGE_TOKEN`), the tokenizer's
``<image>`` marker; a prompt carries it once per image and the engine expands it to
:data:`NUM_IMAGE_TOKENS` positions.
"""

from __future__ import annotations

import copy
import io
import random
from pathlib import Path
from typing import NamedTuple

import torch
from PIL import Image
from transformers import CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

from refengine.config import CacheConfig, EngineConfig, SchedulerConfig
from refengine.engine.core import KvEventSink
from refengine.engine.engine import Engine
from refengine.engine.media import MediaInputs
from refengine.model.loader import load_model_config, load_weights
from tests.unit.tokenizer_fixture import byte_fallback_tokenizer

TOKENIZER = copy.deepcopy(byte_fallback_tokenizer())  # a copy: the cached one is shared by other tests
TOKENIZER.add_special_tokens({"additional_special_tokens": ["<image>"]})  # the text marker of the placeholder
VOCAB = len(TOKENIZER)
IMAGE_TOKEN = VOCAB - 1
NUM_IMAGE_TOKENS = 16
IMAGE_SIZE = 56


class TinyLlava(NamedTuple):
    """The transformers model (the oracle), its image processor and the saved checkpoint."""

    model: LlavaForConditionalGeneration
    processor: CLIPImageProcessor
    directory: Path


def build_tiny_llava(directory: Path) -> TinyLlava:
    """Build the seeded tiny LLaVA and save model, image processor and tokenizer to ``directory``."""
    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=IMAGE_SIZE, patch_size=14, projection_dim=32)
    text = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, eos_token_id=2)
    model = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text,
                                                      image_token_index=IMAGE_TOKEN)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.08)
    directory = Path(directory)
    model.save_pretrained(directory)
    processor = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                   crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor.save_pretrained(directory)
    TOKENIZER.save_pretrained(directory)  # tokenizer.json + tokenizer_config.json: what the loader needs
    return TinyLlava(model, processor, directory)


def make_engine(directory: Path, budget: int = 512, num_blocks: int = 256, max_model_len: int = 512,
                kv_event_sink: KvEventSink | None = None) -> Engine:
    """An in-process engine on the checkpoint (float32, 4-token KV blocks)."""
    config = EngineConfig(max_model_len=max_model_len, max_sequences_per_request=4,
                          cache=CacheConfig(block_size=4, num_blocks=num_blocks),
                          scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8))
    model_config, weights = load_model_config(directory), load_weights(directory)
    media = MediaInputs.from_model(directory, model_config, weights, torch.float32, "cpu", config.media)
    return Engine(config, model_config, weights, TOKENIZER, model_fingerprint="tiny-llava", media=media,
                  kv_event_sink=kv_event_sink)


def png(seed: int, size: tuple[int, int]) -> bytes:
    """A PNG of seeded random RGB noise."""
    rng = random.Random(seed)
    image = Image.new("RGB", size)
    image.putdata([(rng.randrange(256), rng.randrange(256), rng.randrange(256)) for _ in range(size[0] * size[1])])
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def prompt_with(num_images: int, seed: int = 0) -> list[int]:
    """Token ids: 5 random text ids, then per image the placeholder and 3 more text ids."""
    rng = random.Random(seed)
    ids = [rng.randrange(3, VOCAB - 1) for _ in range(5)]
    for _ in range(num_images):
        ids += [IMAGE_TOKEN] + [rng.randrange(3, VOCAB - 1) for _ in range(3)]
    return ids
