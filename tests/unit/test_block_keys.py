"""``refengine.kv.block_keys`` reproduces the engine's own prefix-cache keys offline, for
random prompts, salts and chunkings, and its documented algorithm is checked byte by byte."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest

from refengine.config import CacheConfig, EngineConfig, SchedulerConfig
from refengine.engine.engine import Engine
from refengine.kv import block_hash_u64, block_keys, engine_extra_keys
from refengine.types import BlockStored, GenerationRequest, KvParams, SamplingParams, StoppingParams
from tests.tiny_models import hf_weights, make_tiny_hf_model, model_config_from_hf
from tests.unit.tokenizer_fixture import byte_fallback_tokenizer

TOKENIZER = byte_fallback_tokenizer()
BLOCK = 4


def documented_key(parent: bytes | None, tokens: list[int], extra: tuple[str, ...]) -> bytes:
    """The algorithm exactly as ``refengine/kv/keys.py`` documents it, written independently."""
    data = parent or bytes(32)
    data += b"".join(struct.pack("<I", t) for t in tokens)
    for key in extra:
        data += struct.pack("<I", len(key.encode())) + key.encode()
    return hashlib.sha256(data).digest()


def test_documented_algorithm() -> None:
    rng = random.Random(1)
    tokens = [rng.randrange(50_000) for _ in range(11)]
    extra = engine_extra_keys("fp", "salty")
    keys = block_keys(tokens, BLOCK, extra)
    assert len(keys) == 2  # the trailing partial block has no key
    first = documented_key(None, tokens[:4], extra)
    assert keys == [first, documented_key(first, tokens[4:8], extra)]
    assert block_hash_u64(first) == int.from_bytes(first, "big") & (2**64 - 1)  # vLLM's conversion: the low 64 bits


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_hf_model(vocab_size=len(TOKENIZER), max_position_embeddings=256)
    return model_config_from_hf(model), hf_weights(model)


@pytest.mark.parametrize("budget", [512, 5, 3], ids=["whole", "chunks-of-5", "chunks-of-3"])
def test_offline_keys_equal_the_engines(tiny, budget: int) -> None:
    events: list = []
    config, weights = tiny
    engine = Engine(EngineConfig(max_model_len=256, cache=CacheConfig(block_size=BLOCK, num_blocks=256),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16)),
                    config, weights, TOKENIZER, model_fingerprint="tiny-fp", kv_event_sink=events.extend)
    rng = random.Random(budget)
    requests, expected = [], {}
    for i in range(12):
        prompt = [rng.randrange(3, len(TOKENIZER)) for _ in range(rng.randrange(4, 40))]
        salt = rng.choice([None, "a", "tenant-7"])
        requests.append(GenerationRequest(f"k{i}", prompt_token_ids=prompt, kv=KvParams(cache_salt=salt),
                                          sampling=SamplingParams(temperature=0.0),
                                          stopping=StoppingParams(max_tokens=3, ignore_eos=True)))
        for key in block_keys(prompt, BLOCK, engine_extra_keys("tiny-fp", salt)):
            expected[key] = salt
    engine.run_until_done(requests)
    stored = {e.block_hash for e in events if isinstance(e, BlockStored)}
    assert set(expected) <= stored  # every offline prompt key is one the engine published
    assert set(expected) <= set(engine.core.pool.hash_to_block)  # and still holds (no eviction here)
