"""The encoder cache is bounded in bytes as well as entries (``multimodal/encoder_cache.py``).

Entries alone did not bound memory: one entry of a large vision model is megabytes, and 256 of
them could hold gigabytes that no budget counted. The engine's cache takes its byte bound from
``MediaConfig.encoder_cache_bytes`` (``--media-cache-mib``).
"""

from __future__ import annotations

import argparse

import pytest
import torch

from refengine.args import add_engine_args
from refengine.args_config import engine_config_from_args
from refengine.config import MediaConfig
from refengine.engine.media import MediaInputs
from refengine.model.loader import load_model_config, load_weights
from refengine.multimodal.encoder_cache import EncoderCache
from refengine.types import MediaInput
from tests import tiny_llava


def sized(max_entries: int, max_bytes: int) -> EncoderCache[bytes]:
    return EncoderCache(max_entries, max_bytes, len)


def test_least_recently_used_entries_go_first_when_the_bytes_run_out() -> None:
    cache = sized(10, 100)
    for key in "abc":
        cache.put(key, b"x" * 30)
    assert cache.num_bytes == 90 and len(cache) == 3
    assert cache.get("a") == b"x" * 30  # now the most recently used
    cache.put("d", b"y" * 50)  # 140 bytes: "b" then "c" must go, not "a"; 100 is within the bound
    assert [cache.get(key) is not None for key in "abcd"] == [True, False, False, True]
    assert cache.num_bytes == 80
    cache.put("e", b"z" * 20)
    assert cache.num_bytes == 100 and len(cache) == 3


def test_an_entry_larger_than_the_bound_is_not_kept_and_evicts_nothing() -> None:
    cache = sized(10, 100)
    cache.put("small", b"s" * 60)
    cache.put("huge", b"h" * 101)
    assert cache.get("huge") is None and cache.get("small") == b"s" * 60 and cache.num_bytes == 60


def test_putting_a_key_again_replaces_its_size() -> None:
    cache = sized(10, 100)
    cache.put("a", b"x" * 80)
    cache.put("a", b"x" * 10)
    assert cache.num_bytes == 10 and len(cache) == 1
    cache.put("a", b"x" * 101)  # too large now: the old entry goes too, not a stale one kept
    assert cache.get("a") is None and cache.num_bytes == 0


def test_entries_still_bound_the_count_and_zero_turns_it_off() -> None:
    cache = sized(2, 1000)
    for key in "abc":
        cache.put(key, b"z")
    assert len(cache) == 2 and cache.get("a") is None and cache.num_bytes == 2
    off = sized(0, 1000)
    off.put("a", b"z")
    assert len(off) == 0 and off.num_bytes == 0


def test_the_engine_cache_takes_its_bound_from_the_media_config(tmp_path) -> None:
    llava = tiny_llava.build_tiny_llava(tmp_path)
    config, weights = load_model_config(llava.directory), load_weights(llava.directory)

    def media(cache_bytes: int) -> MediaInputs:
        inputs = MediaInputs.from_model(llava.directory, config, weights, torch.float32, "cpu",
                                        MediaConfig(encoder_cache_bytes=cache_bytes))
        assert inputs is not None
        return inputs

    images = [MediaInput("image", raw_bytes=tiny_llava.png(seed, (56, 56))) for seed in range(3)]
    prompt = tiny_llava.prompt_with(3)
    unbounded = media(1 << 30)
    _, runs = unbounded.prepare(prompt, images)
    entry_bytes = runs[0].embeds.numel() * runs[0].embeds.element_size()
    assert len(unbounded.cache) == 3 and unbounded.cache.num_bytes == 3 * entry_bytes
    two = media(2 * entry_bytes)
    two.prepare(prompt, images)
    assert len(two.cache) == 2 and two.cache.num_bytes == 2 * entry_bytes
    assert two.cache.get(runs[0].identity) is None  # the first image, least recently used, went
    off = media(0)
    off.prepare(prompt, images)
    assert len(off.cache) == 0


@pytest.mark.parametrize(("flag", "cache_bytes"), [([], 256 << 20), (["--media-cache-mib", "1.5"], 3 << 19),
                                                  (["--media-cache-mib", "0"], 0)])
def test_the_flag_sets_the_bound(flag: list[str], cache_bytes: int) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(flag)
    assert engine_config_from_args(args).media.encoder_cache_bytes == cache_bytes


def test_a_negative_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="encoder_cache_bytes"):
        MediaConfig(encoder_cache_bytes=-1)
