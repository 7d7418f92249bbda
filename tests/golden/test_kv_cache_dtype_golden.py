"""--kv-cache-dtype bfloat16 / float16 under float32 weights, on SmolLM2-135M.

Oracle: transformers in float32 on the same weights, attending through an attention function
registered with transformers' ``AttentionInterface`` that rounds keys and values to the cache
dtype first: a 16-bit KV cache modelled inside the oracle's own forward (its projections,
rotary embedding, cache and SDPA call are transformers'; only the two roundings are ours). The
engine's greedy tokens are that oracle's (checked teacher-forced: one oracle forward over the
prompt and the engine's tokens, each of which must be its argmax; ``first_disagreement``), and
its logits are within a documented tolerance of it. The tolerance cannot be float32's: the two
compute each key in float32 in a different order, and a key within 1e-6 of a rounding midpoint
rounds to the other 16-bit neighbour; that difference grows through 30 layers, each one's keys
rounding afresh. (The exact claim, attention over a 16-bit cache = float64 attention over keys
rounded to it, is tests/unit/test_kv_cache_dtype.py's.) Because the engine rounds the step's
own keys too, a 16-bit cache keeps G18: greedy output is identical alone (the longest prompt),
chunked, in a mixed batch and on prefix-cache hits. Against plain float32 transformers, greedy agreement is
measured and printed (tokens until the first divergence per golden prompt).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import transformers
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from refengine.config import CacheConfig, EngineConfig, SchedulerConfig
from refengine.engine.engine import Engine
from refengine.kernels.attention import make_attention_backend
from refengine.kernels.attention.cpu_paged import native_kernel_unavailable_reason
from refengine.model.dtypes import DTYPES
from refengine.model.runner import ModelRunner
from refengine.scheduler.sequence import Sequence
from refengine.types import GenerationRequest, SamplingParams, StoppingParams
from tests.golden.conftest import NUM_TOKENS, PROMPTS, first_disagreement
from tests.golden.test_engine_golden import greedy_request
from tests.step_helpers import run_step

pytestmark = pytest.mark.golden
#: Largest |logit difference| against the rounded-KV oracle (see the module docstring; measured on
#: these prompts: 0.14-0.19 for bfloat16, 0.02 for float16).
LOGIT_TOLERANCE = {"bfloat16": 0.4, "float16": 0.06}
NATIVE = native_kernel_unavailable_reason()


@pytest.fixture(scope="module", params=["bfloat16", "float16"])
def kv_dtype(request: pytest.FixtureRequest) -> str:
    return request.param


def rounded_kv_attention(kv: torch.dtype) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """transformers' SDPA attention over keys and values rounded to ``kv`` (a ``kv`` cache)."""
    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        return sdpa_attention_forward(module, query, key.to(kv).to(query.dtype), value.to(kv).to(query.dtype),
                                      attention_mask, **kwargs)
    return attention


@pytest.fixture(scope="module")
def hf_rounded(smollm2_dir, kv_dtype: str) -> transformers.LlamaForCausalLM:
    name = f"refengine_kv_{kv_dtype}"
    transformers.AttentionInterface.register(name, rounded_kv_attention(DTYPES[kv_dtype]))
    return transformers.LlamaForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32, local_files_only=True, attn_implementation=name).eval()


def make_engine(model_parts, kv_dtype: str, budget: int = 2048, num_blocks: int = 512) -> Engine:
    config, weights, tokenizer, fingerprint = model_parts
    engine_config = EngineConfig(kv_cache_dtype=kv_dtype, cache=CacheConfig(block_size=16, num_blocks=num_blocks),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=64))
    return Engine(engine_config, config, weights, tokenizer, model_fingerprint=fingerprint)


@pytest.fixture(scope="module")
def prompt_ids(model_parts) -> list[list[int]]:
    return [model_parts[2].encode(p, add_special_tokens=False) for p in PROMPTS]


@pytest.fixture(scope="module")
def together(model_parts, prompt_ids, kv_dtype: str) -> list[list[int]]:
    """Greedy tokens of the golden prompts run as one batch: the reference the oracle checks and
    the other runs must equal. (Each prompt alone would take 8x the decode steps: with a 16-bit
    cache, only the longest prompt runs alone, in the identity test below; every prompt alone
    against the batch is test_engine_golden.py's, with the float32 cache.)"""
    engine = make_engine(model_parts, kv_dtype)
    assert {k.dtype for k, _ in engine.core.runner.kv_caches} == {DTYPES[kv_dtype]}
    return [r.outputs[0].token_ids for r in engine.run_until_done(
        [greedy_request(i, ids) for i, ids in enumerate(prompt_ids)])]


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=pytest.mark.skipif(
    bool(NATIVE), reason=f"native CPU kernel: {NATIVE}"))])
@pytest.mark.parametrize("repeat", [1, 8], ids=["short", "long"])  # long: the first chunk is a fresh prompt >= 64
def test_logits_match_transformers_with_a_rounded_cache(model_parts, hf_rounded, prompt_ids, kv_dtype, backend,
                                                        repeat) -> None:
    config, weights, _, _ = model_parts
    kv = DTYPES[kv_dtype]
    runner = ModelRunner(config, weights, CacheConfig(block_size=16, num_blocks=64), 2048, kv_dtype=kv,
                         attention=make_attention_backend(backend, torch.float32, "cpu", kv_dtype=kv))
    ids = (prompt_ids[2] + prompt_ids[6]) * repeat
    with torch.no_grad():
        reference = hf_rounded(torch.tensor([ids])).logits[0]
    prefill_len = len(ids) - 3
    seq = Sequence("g", 0, list(ids[:prefill_len]), prefill_len)
    seq.block_table = list(range(len(ids) // 16 + 1))
    got = []
    half = prefill_len // 2  # a prefill in two chunks (the second reads the first's keys back), then 3 decodes
    for num_new in (half, prefill_len - half):
        got.append(run_step(runner, seq, num_new, all_logits=True))
        seq.num_computed_tokens += num_new
    for pos in range(prefill_len, len(ids)):
        seq.token_ids.append(ids[pos])
        got.append(run_step(runner, seq, 1))
        seq.num_computed_tokens += 1
    max_diff = (torch.cat(got) - reference).abs().max().item()
    print(f"\n{kv_dtype} KV, {backend}, {len(ids)} tokens: max |logit difference| {max_diff:.4f}")
    assert max_diff <= LOGIT_TOLERANCE[kv_dtype], f"engine ({kv_dtype} KV) vs transformers (rounded KV): {max_diff}"


def test_greedy_matches_transformers_with_a_rounded_cache(together, hf_rounded, prompt_ids, kv_dtype) -> None:
    """Each token is the oracle's argmax, or within LOGIT_TOLERANCE of it: the logits are proven
    to that tolerance only (above), and a near-tie may go either way. On an AMD EPYC (AVX512-BF16,
    no AMX) prompt 4's token 21 (bfloat16) was 0.005 below the oracle's maximum; on an Intel
    Xeon with AMX every token was the argmax."""
    for i, ids in enumerate(prompt_ids):
        assert len(together[i]) == NUM_TOKENS
        at = first_disagreement(hf_rounded, ids, together[i], tie_margin=LOGIT_TOLERANCE[kv_dtype])
        assert at == NUM_TOKENS, f"prompt {i} ({PROMPTS[i]!r}): token {at} is not the oracle's greedy choice"


def test_greedy_identical_alone_chunked_batched_and_on_prefix_hits(model_parts, prompt_ids, together,
                                                                   kv_dtype) -> None:
    """G18 with a 16-bit cache: the golden batch's tokens for its longest prompt alone, for all
    with a 16-token budget (every prompt chunked), beside 8 sampled neighbours, and on a second
    run whose prompts hit the prefix cache."""
    longest = max(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    (alone,) = make_engine(model_parts, kv_dtype).run_until_done([greedy_request(longest, prompt_ids[longest])])
    assert alone.outputs[0].token_ids == together[longest]
    chunked = make_engine(model_parts, kv_dtype, budget=16)
    results = chunked.run_until_done([greedy_request(i, ids) for i, ids in enumerate(prompt_ids)])
    assert [r.outputs[0].token_ids for r in results] == together
    engine = make_engine(model_parts, kv_dtype)
    noise = [GenerationRequest(request_id=f"noise-{j}", prompt_token_ids=prompt_ids[j] * (1 + j % 3),
                               sampling=SamplingParams(temperature=0.9, top_p=0.9, seed=j),
                               stopping=StoppingParams(max_tokens=8 + 5 * j)) for j in range(8)]
    batch = engine.run_until_done([greedy_request(i, ids) for i, ids in enumerate(prompt_ids)] + noise)
    assert [r.outputs[0].token_ids for r in batch[:8]] == together
    long_ids = [ids * 6 for ids in prompt_ids]  # long enough to fill several blocks
    first = engine.run_until_done([greedy_request(i, ids, f"long-{i}") for i, ids in enumerate(long_ids)])
    again = engine.run_until_done([greedy_request(i, ids, f"again-{i}") for i, ids in enumerate(long_ids)])
    assert all(r.usage.cached_prompt_tokens >= 16 for r in again)
    assert [r.outputs[0].token_ids for r in again] == [r.outputs[0].token_ids for r in first]
    engine.core.check_idle()
    assert engine.core.pool.num_used == 0


def test_greedy_agreement_with_plain_fp32_transformers(together, hf_smollm2, prompt_ids, kv_dtype) -> None:
    """How long greedy output stays with float32 transformers whose cache is not rounded
    (printed per prompt). Measured 48 of 48 on every golden prompt for both dtypes; required:
    at least half the tokens on average (the 16-bit cache may flip a near-tie)."""
    agreement = [first_disagreement(hf_smollm2, ids, ours) for ids, ours in zip(prompt_ids, together, strict=True)]
    print(f"\n{kv_dtype} KV: tokens equal to fp32 transformers before the first divergence, of {NUM_TOKENS}: "
          f"{agreement} (mean {sum(agreement) / len(agreement):.1f})")
    assert sum(agreement) >= len(agreement) * NUM_TOKENS / 2, agreement
