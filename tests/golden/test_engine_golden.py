"""Golden tests: the engine on SmolLM2-135M (fp32) against transformers, and greedy
bit-identity whatever the batch, chunking, preemption or prefix-cache hits (G18)."""

from __future__ import annotations

import pytest
import torch

from refengine.config import CacheConfig, EngineConfig, SchedulerConfig
from refengine.engine.engine import Engine
from refengine.kernels.attention import make_attention_backend
from refengine.kernels.attention.cpu_paged import native_kernel_unavailable_reason
from refengine.model.runner import ModelRunner
from refengine.scheduler.sequence import Sequence
from refengine.types import GenerationRequest, SamplingParams, StoppingParams
from tests.golden.conftest import NUM_TOKENS, PROMPTS, first_disagreement
from tests.step_helpers import run_step

pytestmark = pytest.mark.golden


def make_engine(model_parts, num_blocks: int = 512, budget: int = 2048, max_seqs: int = 64) -> Engine:
    config, weights, tokenizer, fingerprint = model_parts
    engine_config = EngineConfig(
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs),
    )
    return Engine(engine_config, config, weights, tokenizer, model_fingerprint=fingerprint)


def greedy_request(i: int, prompt_ids: list[int], rid: str | None = None) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid or f"greedy-{i}",
        prompt_token_ids=prompt_ids,
        sampling=SamplingParams(temperature=0.0),
        stopping=StoppingParams(max_tokens=NUM_TOKENS, ignore_eos=True),
    )


@pytest.fixture(scope="module")
def prompt_ids(model_parts) -> list[list[int]]:
    tokenizer = model_parts[2]
    return [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


@pytest.fixture(scope="module")
def alone(model_parts, prompt_ids) -> list[list[int]]:
    engine = make_engine(model_parts)
    return [
        engine.run_until_done([greedy_request(i, ids)])[0].outputs[0].token_ids
        for i, ids in enumerate(prompt_ids)
    ]


ATTENTION_BACKENDS = [
    "torch",
    pytest.param("cpu", marks=pytest.mark.skipif(bool(native_kernel_unavailable_reason()),
                                                 reason=f"native CPU kernel: {native_kernel_unavailable_reason()}")),
]


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
@pytest.mark.parametrize("repeat", [1, 8], ids=["short", "long"])  # long: the first chunk is a fresh prompt >= 64
def test_prefill_and_decode_logits_match_transformers(model_parts, hf_smollm2, prompt_ids, backend, repeat) -> None:
    config, weights, _, _ = model_parts
    runner = ModelRunner(config, weights, CacheConfig(block_size=16, num_blocks=64), 2048,
                         attention=make_attention_backend(backend, torch.float32, "cpu"))
    ids = (prompt_ids[2] + prompt_ids[6]) * repeat
    with torch.no_grad():
        reference = hf_smollm2(torch.tensor([ids])).logits[0]
    prefill_len = len(ids) - 3
    seq = Sequence("g", 0, list(ids[:prefill_len]), prefill_len)
    seq.block_table = list(range(len(ids) // 16 + 1))
    got = []
    half = prefill_len // 2  # a prefill in two chunks, then three decode steps
    for num_new in (half, prefill_len - half):
        got.append(run_step(runner, seq, num_new, all_logits=True))
        seq.num_computed_tokens += num_new
    for pos in range(prefill_len, len(ids)):
        seq.token_ids.append(ids[pos])
        got.append(run_step(runner, seq, 1))
        seq.num_computed_tokens += 1
    assert seq.num_computed_tokens == len(ids)
    max_diff = (torch.cat(got) - reference).abs().max().item()
    assert max_diff <= 1e-3, f"engine vs transformers logits differ by {max_diff}"


def test_greedy_matches_transformers(alone, hf_smollm2, prompt_ids) -> None:
    for i, (ids, ours) in enumerate(zip(prompt_ids, alone, strict=True)):
        assert len(ours) == NUM_TOKENS
        at = first_disagreement(hf_smollm2, ids, ours)
        assert at == NUM_TOKENS, f"prompt {i} ({PROMPTS[i]!r}): token {at} is not transformers' greedy choice"


def test_greedy_identical_inside_a_mixed_batch_of_32(model_parts, prompt_ids, alone) -> None:
    engine = make_engine(model_parts)
    requests = [greedy_request(i, ids) for i, ids in enumerate(prompt_ids)]
    for j in range(24):  # sampled neighbours with various lengths and settings
        requests.append(
            GenerationRequest(
                request_id=f"noise-{j}",
                prompt_token_ids=prompt_ids[j % 8] * (1 + j % 3),
                sampling=SamplingParams(
                    temperature=0.8 + 0.02 * j, top_p=0.9, top_k=50 if j % 2 else 0, seed=j
                ),
                stopping=StoppingParams(max_tokens=8 + 4 * (j % 10)),
            )
        )
    results = engine.run_until_done(requests)
    assert [r.outputs[0].token_ids for r in results[:8]] == alone
    assert engine.core.pool.num_used == 0


def test_greedy_identical_with_forced_chunking(model_parts, prompt_ids, alone) -> None:
    engine = make_engine(model_parts, budget=16)
    results = engine.run_until_done([greedy_request(i, ids) for i, ids in enumerate(prompt_ids)])
    assert [r.outputs[0].token_ids for r in results] == alone


def test_greedy_identical_under_preemption(model_parts, prompt_ids, alone) -> None:
    engine = make_engine(model_parts, num_blocks=12)  # 8 sequences need ~5 blocks each at the end
    preemptions = []
    original = engine.core.scheduler._preempt

    def counting_preempt(seq):
        preemptions.append(seq.request_id)
        original(seq)

    engine.core.scheduler._preempt = counting_preempt
    results = engine.run_until_done([greedy_request(i, ids) for i, ids in enumerate(prompt_ids)])
    assert preemptions, "the pool was meant to be small enough to force preemption"
    assert [r.outputs[0].token_ids for r in results] == alone
    engine.core.check_idle()
    assert engine.core.pool.num_used == 0


def test_greedy_identical_on_prefix_cache_hits(model_parts, prompt_ids, alone) -> None:
    engine = make_engine(model_parts)
    long_ids = [ids * 6 for ids in prompt_ids]  # long enough to fill several blocks
    first = engine.run_until_done([greedy_request(i, ids) for i, ids in enumerate(long_ids)])
    second = engine.run_until_done([greedy_request(i, ids, f"again-{i}") for i, ids in enumerate(long_ids)])
    assert all(r.usage.cached_prompt_tokens == 0 for r in first)
    assert all(r.usage.cached_prompt_tokens >= 16 for r in second)
    assert [r.outputs[0].token_ids for r in first] == [r.outputs[0].token_ids for r in second]
    # The short prompts: a third run with them must still equal the lone run.
    third = engine.run_until_done([greedy_request(i, ids, f"short-{i}") for i, ids in enumerate(prompt_ids)])
    assert [r.outputs[0].token_ids for r in third] == alone


def test_seeded_sampling_same_alone_and_in_batch(model_parts, prompt_ids) -> None:
    engine = make_engine(model_parts)

    def sampled(rid: str, seed: int) -> GenerationRequest:
        return GenerationRequest(
            request_id=rid,
            prompt_token_ids=prompt_ids[1],
            sampling=SamplingParams(temperature=1.0, seed=seed),
            stopping=StoppingParams(max_tokens=24, ignore_eos=True),
        )

    solo = engine.run_until_done([sampled("solo", 7)])[0].outputs[0].token_ids
    batch = engine.run_until_done([sampled(f"n{i}", 100 + i) for i in range(5)] + [sampled("in-batch", 7)])
    assert batch[-1].outputs[0].token_ids == solo
    assert len({tuple(r.outputs[0].token_ids) for r in batch}) == len(batch), "different seeds must differ"
