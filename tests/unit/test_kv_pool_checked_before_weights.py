"""A KV pool the flags make impossible fails before the weights load: from config.json and the
flags alone (found by review: --block-size 100000 and --num-kv-blocks 2**63-1 failed only after a
whole load, minutes for a large model)."""

from __future__ import annotations

import pytest

from refengine.config import CacheConfig, EngineConfig
from refengine.engine.engine import Engine
from refengine.model import loader


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights were loaded before the KV pool was checked")

    monkeypatch.setattr(loader, "load_weights", refuse)


@pytest.mark.parametrize(("cache", "says"), [
    (CacheConfig(block_size=100_000), "--kv-memory-mib 1024 holds no KV block of 100000 tokens"),
    (CacheConfig(num_blocks=(1 << 63) - 1), "available; lower --kv-memory-mib or --num-kv-blocks"),
])
def test_an_impossible_pool_fails_before_the_weights(no_weights: None, cache: CacheConfig, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        Engine.from_config(EngineConfig(cache=cache))
