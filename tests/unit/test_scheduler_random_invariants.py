"""Guards for scheduler/KV invariants the other tests cover only one at a time: greedy
outputs of n > 1 requests under preemption + chunking + prefix hits equal each request alone
(G18), and a KV-event subscriber's view stays the pool's published set through preemption,
forks, aborts and cache resets (E3, E4)."""

from __future__ import annotations

import random

import pytest

from refengine.config import CacheConfig, EngineConfig, SchedulerConfig
from refengine.engine.engine import Engine
from refengine.types import (
    GenerationRequest,
    SamplingParams,
    StoppingParams,
)
from tests.tiny_models import hf_weights, make_tiny_hf_model, model_config_from_hf
from tests.unit.kv_helpers import replay
from tests.unit.tokenizer_fixture import byte_fallback_tokenizer

TOKENIZER = byte_fallback_tokenizer()
VOCAB = len(TOKENIZER)
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_hf_model(vocab_size=VOCAB, max_position_embeddings=256)
    return model_config_from_hf(model), hf_weights(model)


def make_engine(tiny, num_blocks: int, budget: int, block_size: int, sink=None) -> Engine:
    config, weights = tiny
    return Engine(EngineConfig(max_model_len=256, debug_kv_integrity=True, max_sequences_per_request=3,
                               cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
                               scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=6)),
                  config, weights, TOKENIZER, model_fingerprint="tiny", kv_event_sink=sink)


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def greedy(rid: str, prompt: list[int], n: int) -> GenerationRequest:
    return GenerationRequest(rid, prompt_token_ids=prompt, sampling=SamplingParams(temperature=0.0, num_sequences=n),
                             stopping=StoppingParams(max_tokens=MAX_TOKENS, ignore_eos=True))


# (blocks, budget, block size): tight pools preempt, small budgets chunk, repeats hit the cache.
@pytest.mark.parametrize("num_blocks,budget,block_size", [(11, 64, 4), (13, 3, 3), (5, 5, 8)])
def test_n_greedy_outputs_equal_each_request_alone_under_preemption(tiny, num_blocks, budget, block_size) -> None:
    shared = ids(100, 10)
    prompts = [shared + ids(i, 2 + i) for i in range(4)] + [ids(9, 7)]
    reference = make_engine(tiny, 256, 512, 4)
    alone = {}
    for i, prompt in enumerate(prompts):
        (done,) = reference.run_until_done([greedy(f"r{i}", prompt, 1)])
        alone[f"r{i}"] = [t.token_id for t in done.outputs[0].tokens]
    engine = make_engine(tiny, num_blocks, budget, block_size)
    for _ in range(2):  # the second round starts with the first round's blocks cached
        for done in engine.run_until_done([greedy(f"r{i}", p, 3) for i, p in enumerate(prompts)]):
            assert [[t.token_id for t in o.tokens] for o in done.outputs] == [alone[done.request_id]] * 3
        engine.core.check_idle()


def test_event_view_tracks_the_pool_through_preemption_forks_aborts_and_resets(tiny) -> None:
    view: dict[bytes, bytes | None] = {}
    engine = make_engine(tiny, 12, 5, 2, sink=lambda events: replay(view, events))
    rng = random.Random(3)
    for step in range(90):
        if rng.random() < 0.4:
            plen = rng.randrange(1, 10)
            engine.add_request(greedy(f"r{step}", (ids(rng.randrange(2), 6) + ids(step, plen))[:plen],
                                      rng.choice([1, 2, 3])), lambda out: None)
        if rng.random() < 0.1:
            engine.abort(f"r{rng.randrange(step + 1)}")
        if rng.random() < 0.04:
            engine.reset_prefix_cache()
        engine.step()
        assert set(view) == set(engine.core.pool.hash_to_block)
        assert {e.block_hash: e.parent_hash for e in engine.core.pool.snapshot()} == view
    while engine.has_unfinished_requests:
        engine.step()
    engine.core.check_idle()
