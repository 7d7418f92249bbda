"""The CPU bf16 path on SmolLM2-135M: bf16 weights on oneDNN's prepacked bf16 GEMMs and a bf16
KV cache read by the native attention kernel (float32 accumulation), on CPUs with native bf16
dot products (``kernels/cpu_features.py``; skipped elsewhere, naming why).

Oracles: transformers in bf16 on the same weights (logits, within a documented tolerance), and
transformers in fp32 (greedy agreement, measured: tokens until the first divergence per golden
prompt, printed; bf16 rounding makes some divergence expected).

Batch-invariant (G18), as float32 is: greedy output is identical alone, in a mixed batch of 32,
with forced chunking, under preemption and on prefix-cache hits. oneDNN's bf16 GEMM takes
another kernel (another rounding) for other row counts; ``kernels/linear.py`` runs every oneDNN
bf16 call in calls of one fixed row count, which is what makes these hold where oneDNN runs them.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers

from refengine.config import CacheConfig, EngineConfig, SchedulerConfig
from refengine.engine.engine import Engine
from refengine.kernels.attention.cpu_paged import CpuPagedBackend, amx_form_available
from refengine.kernels.cpu_features import native_bf16
from refengine.types import GenerationRequest, LogprobParams, SamplingParams, StoppingParams
from tests.golden.conftest import NUM_TOKENS, PROMPTS, first_disagreement
from tests.golden.test_engine_golden import greedy_request

pytestmark = [pytest.mark.golden,
              pytest.mark.skipif(not native_bf16(), reason="this CPU has no native bf16 (avx512_bf16 / amx_bf16)")]
#: Largest |logit difference| against transformers in bf16 on the same weights: both round every
#: activation to bf16, but accumulate in different orders (oneDNN vs torch's kernels).
LOGIT_TOLERANCE = 0.6


@pytest.fixture(scope="module")
def bf16_parts(model_parts):
    config, weights, tokenizer, fingerprint = model_parts
    return config, {name: w.to(torch.bfloat16) for name, w in weights.items()}, tokenizer, fingerprint


def make_engine(parts, num_blocks: int = 512, budget: int = 2048) -> Engine:
    config, weights, tokenizer, fingerprint = parts
    engine_config = EngineConfig(dtype="bfloat16", cache=CacheConfig(block_size=16, num_blocks=num_blocks),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=64))
    return Engine(engine_config, config, weights, tokenizer, model_fingerprint=fingerprint)


@pytest.fixture(scope="module")
def prompt_ids(model_parts) -> list[list[int]]:
    return [model_parts[2].encode(p, add_special_tokens=False) for p in PROMPTS]


@pytest.fixture(scope="module")
def alone(bf16_parts, prompt_ids) -> list[list[int]]:
    engine = make_engine(bf16_parts)
    assert isinstance(engine.core.runner.attention, CpuPagedBackend)
    # On AMX the cache is in the AMX form's layout, and the layout string engines compare says so.
    assert engine.kv_layout().startswith("CpuPagedBackend/amx:" if amx_form_available() else "CpuPagedBackend:")
    return [engine.run_until_done([greedy_request(i, ids)])[0].outputs[0].token_ids for i, ids in enumerate(prompt_ids)]


def test_logits_match_transformers_bf16(bf16_parts, smollm2_dir, prompt_ids) -> None:
    hf = transformers.LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16, local_files_only=True).eval()
    engine = make_engine(bf16_parts)
    for ids in prompt_ids[:4]:
        request = replace(greedy_request(0, ids, rid=f"logits-{len(ids)}"),
                          logprobs=LogprobParams(output_logprobs=True))
        with torch.no_grad():
            reference = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), -1)
        got = engine.run_until_done([request])[0].outputs[0].tokens[0]
        assert abs(got.logprob - reference[got.token_id].item()) <= LOGIT_TOLERANCE
        assert got.token_id == int(reference.argmax()) or reference.max() - reference[got.token_id] <= LOGIT_TOLERANCE


def test_greedy_agreement_with_fp32_transformers(alone, hf_smollm2, prompt_ids) -> None:
    agreement = [first_disagreement(hf_smollm2, ids, ours) for ids, ours in zip(prompt_ids, alone, strict=True)]
    print(f"\nbf16 vs fp32 transformers, greedy tokens until the first divergence: {agreement} of {NUM_TOKENS}")
    assert min(agreement) >= 1 and sum(agreement) >= NUM_TOKENS * len(alone) // 4, agreement




def test_greedy_identical_in_a_mixed_batch_chunked_and_preempted(bf16_parts, prompt_ids, alone) -> None:
    """G18 in bf16: beside 24 sampled neighbours, with a 16-token budget, and in a pool small
    enough to preempt."""
    engine = make_engine(bf16_parts)
    noise = [GenerationRequest(f"noise-{j}", prompt_token_ids=prompt_ids[j % 8] * (1 + j % 3),
                               sampling=SamplingParams(temperature=0.8 + 0.02 * j, top_p=0.9, seed=j),
                               stopping=StoppingParams(max_tokens=8 + 4 * (j % 10))) for j in range(24)]
    batch = engine.run_until_done([greedy_request(i, ids) for i, ids in enumerate(prompt_ids)] + noise)
    assert [r.outputs[0].token_ids for r in batch[:8]] == alone
    chunked = make_engine(bf16_parts, budget=16)
    assert [r.outputs[0].token_ids for r in chunked.run_until_done(
        [greedy_request(i, ids) for i, ids in enumerate(prompt_ids)])] == alone
    small = make_engine(bf16_parts, num_blocks=12)
    preemptions: list[str] = []
    original = small.core.scheduler._preempt
    small.core.scheduler._preempt = lambda seq: preemptions.append(seq.request_id) or original(seq)
    results = small.run_until_done([greedy_request(i, ids) for i, ids in enumerate(prompt_ids)])
    assert preemptions, "the pool was meant to be small enough to force preemption"
    assert [r.outputs[0].token_ids for r in results] == alone
    assert small.core.pool.num_used == 0


def test_greedy_identical_on_prefix_cache_hits(bf16_parts, prompt_ids) -> None:
    engine = make_engine(bf16_parts)
    long_ids = [ids * 6 for ids in prompt_ids]
    first = engine.run_until_done([greedy_request(i, ids, f"first-{i}") for i, ids in enumerate(long_ids)])
    again = engine.run_until_done([greedy_request(i, ids, f"again-{i}") for i, ids in enumerate(long_ids)])
    assert all(r.usage.cached_prompt_tokens >= 16 for r in again)
    assert [r.outputs[0].token_ids for r in again] == [r.outputs[0].token_ids for r in first]
