"""G18 at the level of bits: a request's greedy logprobs are the same floats however its prompt
is chunked (the token budget), on a shape the CPU chunk kernel refuses (block size 8), where long
chunks once went to SDPA and gave logits 1 ulp apart (found by review: the tokens agreed, a near
tie would not have)."""

from __future__ import annotations

import random

import pytest

from refengine.config import CacheConfig, EngineConfig, SchedulerConfig
from refengine.engine.engine import Engine
from refengine.types import GenerationRequest, LogprobParams, SamplingParams, StoppingParams
from tests.tiny_models import hf_weights, make_tiny_hf_model, model_config_from_hf
from tests.unit.tokenizer_fixture import byte_fallback_tokenizer

TOKENIZER = byte_fallback_tokenizer()


@pytest.fixture(scope="module")
def tiny():  # noqa: ANN201
    model = make_tiny_hf_model(vocab_size=len(TOKENIZER), max_position_embeddings=256)
    return model_config_from_hf(model), hf_weights(model)


def _logprobs(tiny, budget: int, prompt: list[int]) -> list[tuple[int, float]]:  # noqa: ANN001
    config, weights = tiny
    engine = Engine(EngineConfig(max_model_len=256, max_sequences_per_request=1,
                                 cache=CacheConfig(block_size=8, num_blocks=64),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8)),
                    config, weights, TOKENIZER, model_fingerprint="tiny")
    (done,) = engine.run_until_done([GenerationRequest(
        "a", prompt_token_ids=prompt, sampling=SamplingParams(temperature=0.0),
        stopping=StoppingParams(max_tokens=4, ignore_eos=True), logprobs=LogprobParams(output_logprobs=True))])
    return [(t.token_id, t.logprob) for t in done.outputs[0].tokens]


@pytest.mark.parametrize("length", [64, 100])
def test_greedy_logprobs_are_the_same_bits_however_the_prompt_is_chunked(tiny, length: int) -> None:  # noqa: ANN001
    prompt = [random.Random(length).randrange(3, len(TOKENIZER)) for _ in range(length)]
    whole = _logprobs(tiny, 4096, prompt)
    for budget in (16, 7):
        assert _logprobs(tiny, budget, prompt) == whole, budget
