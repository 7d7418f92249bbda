"""Golden tests for multi-LoRA: the engine on SmolLM2-135M (fp32) with random PEFT adapters,
against transformers + peft as the oracle.

Six adapters cover ranks 4 / 8 / 16, attention-only, MLP-only and all-projection targets, a
subset of layers, rsLoRA on and off, and per-module ranks and alphas (``rank_pattern`` /
``alpha_pattern``, with a layer-specific key that overrides a general one). For each adapter
(and the base model) on two prompts:

* the greedy continuation is PEFT's: every generated token is the oracle's argmax given the
  same prefix (by induction, the same tokens as PEFT's own greedy decoding, which is also
  run once per model);
* the log-probs the engine reports — each prompt position's target and top-20 candidates
  (a prefill), each generated token's and its top-20 (decode steps), and the whole
  vocabulary after the prefill — are the oracle's log-softmax within ``TOL``;
* the adapter changes the greedy output (so the checks are not run on a no-op adapter).

Then a batch mixing four adapters and the base model, two prompts each (the prompts shared
between adapters, so a prefix-cache hit across adapters would show), gives every request
the tokens it got alone: once with four slots (all adapters in one step, cache hits from the
lone runs) and once with two (adapters swap between slots, requests wait for one), leaving
the KV pool idle.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import pytest
import torch

from refengine.config import CacheConfig, EngineConfig, LoraConfig, SchedulerConfig
from refengine.engine.engine import Engine
from refengine.engine.stream import Completion
from refengine.types import (
    CandidateSpec,
    GenerationRequest,
    LogprobParams,
    LoraAdapterSpec,
    SamplingParams,
    StoppingParams,
    TokenInfo,
)
from tests.lora_adapters import PeftOracle, make_peft_adapter

pytestmark = pytest.mark.golden

TOL = 1e-3
NUM_TOKENS = 16
TOP_N = 20
PROMPTS = [
    "Once upon a time, in a small village at the edge of a great forest, there lived an old baker who",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n',
    "The three primary colors are red, yellow and blue. When you mix red and yellow you get",
    "Water boils at a temperature of one hundred degrees Celsius at sea level, but on a high mountain",
]
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# Per-module ranks and alphas. PEFT saves the patterns with sorted keys and applies the first
# key that matches, so the layer-specific q_proj key (sorted first) overrides "q_proj".
RANK_PATTERN = {"down_proj": 16, "layers.2.self_attn.q_proj": 12, "layers.3.self_attn.v_proj": 2, "q_proj": 4}
ALPHA_PATTERN = {"gate_proj": 4, "layers.5.mlp.up_proj": 40, "o_proj": 64}
ADAPTERS: dict[str, dict] = {
    "qv-r4": dict(r=4, target_modules=("q_proj", "v_proj"), lora_alpha=16),
    "all-r8-rslora": dict(r=8, target_modules=ATTENTION + MLP, lora_alpha=16, use_rslora=True),
    "mlp-r16-some-layers": dict(r=16, target_modules=MLP, lora_alpha=32,
                                layers_to_transform=(*range(0, 10), *range(20, 30))),
    "attn-r16-rslora": dict(r=16, target_modules=ATTENTION, lora_alpha=8, use_rslora=True),
    "patterns": dict(r=8, target_modules=ATTENTION + MLP, rank_pattern=RANK_PATTERN, alpha_pattern=ALPHA_PATTERN),
    "patterns-rslora": dict(r=8, target_modules=ATTENTION + MLP, lora_alpha=24, use_rslora=True,
                            rank_pattern=RANK_PATTERN, alpha_pattern=ALPHA_PATTERN),
}
MAX_LORA_RANK = 16
BATCH_ADAPTERS = ("qv-r4", "all-r8-rslora", "mlp-r16-some-layers", "patterns")
BASE = None  # lora_name of the base model


def prompts_for(model: str | None) -> tuple[int, int]:
    """The two prompts (indices) a model is run on: the base model on the first two; adapter
    k on k, k+1 (mod 4), so every prompt is shared by several adapters."""
    if model is BASE:
        return (0, 1)
    k = list(ADAPTERS).index(model)
    return (k % len(PROMPTS), (k + 1) % len(PROMPTS))


def runs() -> list[tuple[str | None, int]]:
    """Every (model, prompt) pair the tests look at: the base model on all prompts (to compare
    each adapter with), each adapter on its two."""
    pairs: list[tuple[str | None, int]] = [(BASE, p) for p in range(len(PROMPTS))]
    pairs += [(name, p) for name in ADAPTERS for p in prompts_for(name)]
    return pairs


# ----------------------------------------------------------------------------- fixtures




@pytest.fixture(scope="module")
def prompt_ids(model_parts) -> list[list[int]]:
    tokenizer = model_parts[2]
    return [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory):
    return tmp_path_factory.mktemp("lora-adapters")


@pytest.fixture(scope="module")
def oracle_and_dirs(hf_smollm2, adapter_root) -> tuple[PeftOracle, dict[str, str]]:
    """The adapters, built and saved by peft, and one PeftModel holding them all — on a copy
    of the base model, since PEFT wraps its modules in place and other tests use the original."""
    base = copy.deepcopy(hf_smollm2)
    dirs = {name: str(make_peft_adapter(base, adapter_root / name, seed=seed, **kwargs))
            for seed, (name, kwargs) in enumerate(ADAPTERS.items(), start=1)}
    return PeftOracle(base, dirs), dirs


@pytest.fixture(scope="module")
def oracle(oracle_and_dirs) -> PeftOracle:
    return oracle_and_dirs[0]


@pytest.fixture(scope="module")
def adapter_dirs(oracle_and_dirs) -> dict[str, str]:
    return oracle_and_dirs[1]


def make_engine(model_parts, root, max_loras: int) -> Engine:
    config, weights, tokenizer, fingerprint = model_parts
    engine_config = EngineConfig(
        max_model_len=256,
        cache=CacheConfig(block_size=16, num_blocks=192),
        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=32),
        lora=LoraConfig(enabled=True, roots=(str(root),), max_loras=max_loras, max_lora_rank=MAX_LORA_RANK,
                        max_loaded_loras=len(ADAPTERS)),
    )
    return Engine(engine_config, config, weights, tokenizer, model_fingerprint=fingerprint)


def load_adapters(engine: Engine, dirs: dict[str, str], names: Sequence[str]) -> None:
    for name in names:
        lora_id = list(ADAPTERS).index(name) + 1
        spec, already = engine.load_lora(LoraAdapterSpec(lora_id, name, dirs[name]))
        assert not already and spec.lora_name == name
    assert sorted(s.lora_name for s in engine.list_loras()) == sorted(names)


@pytest.fixture(scope="module")
def engine(model_parts, adapter_root, adapter_dirs) -> Engine:
    """Four slots, all six adapters loaded (so even the lone runs swap adapters in and out)."""
    engine = make_engine(model_parts, adapter_root, max_loras=4)
    load_adapters(engine, adapter_dirs, list(ADAPTERS))
    first = next(iter(ADAPTERS))
    assert engine.load_lora(LoraAdapterSpec(1, first, adapter_dirs[first]))[1], "a second load is already_loaded"
    return engine


def greedy_request(rid: str, model: str | None, ids: list[int]) -> GenerationRequest:
    """Greedy, EOS ignored, each output token's log-prob and top-20 candidates."""
    return GenerationRequest(
        request_id=rid,
        prompt_token_ids=list(ids),
        sampling=SamplingParams(temperature=0.0),
        stopping=StoppingParams(max_tokens=NUM_TOKENS, ignore_eos=True),
        logprobs=LogprobParams(output_logprobs=True, output_candidates=CandidateSpec("top_n", top_n=TOP_N)),
        lora_name=model,
    )


def scoring_request(rid: str, model: str | None, ids: list[int]) -> GenerationRequest:
    """One prefill of ``ids`` that reports every prompt position's log-prob and top-20, and the
    whole distribution of the one token it then generates."""
    return GenerationRequest(
        request_id=rid,
        prompt_token_ids=list(ids),
        sampling=SamplingParams(temperature=0.0),
        stopping=StoppingParams(max_tokens=1, ignore_eos=True),
        logprobs=LogprobParams(prompt_logprobs=True, prompt_candidates=CandidateSpec("top_n", top_n=TOP_N),
                               output_logprobs=True, output_candidates=CandidateSpec("all")),
        lora_name=model,
    )


def rid_of(model: str | None, prompt: int) -> str:
    return f"{model or 'base'}@{prompt}"


@pytest.fixture(scope="module")
def alone(engine, prompt_ids) -> dict[tuple[str | None, int], Completion]:
    """Each (model, prompt) run by itself on the four-slot engine."""
    results = {}
    for model, p in runs():
        (completion,) = engine.run_until_done([greedy_request(rid_of(model, p), model, prompt_ids[p])])
        assert completion.error is None, completion.error
        assert len(completion.outputs[0].token_ids) == NUM_TOKENS
        results[model, p] = completion
    assert_idle(engine)
    return results


def assert_idle(engine: Engine) -> None:
    engine.core.check_idle()
    assert engine.core.pool.num_used == 0, "KV blocks leaked"


def record_step_adapters(engine: Engine, monkeypatch) -> list[set[int]]:
    """Each step's distinct adapters (``LoadedLora.key``), recorded as the engine assigns slots."""
    steps: list[set[int]] = []
    original = engine.core.lora.step_slots

    def recording(sched, requests):
        steps.append({requests[item.request_id].lora.key for item in sched.scheduled
                      if requests[item.request_id].lora is not None})
        return original(sched, requests)

    monkeypatch.setattr(engine.core.lora, "step_slots", recording)
    return steps


# ----------------------------------------------------------------------------- comparisons


def logprob_errors(infos: Sequence[TokenInfo], reference: torch.Tensor) -> float:
    """Largest |engine - oracle| over each token's log-prob and its candidates' (``reference``:
    the oracle's log-softmax row that predicts each token, one row per info)."""
    worst = 0.0
    for info, row in zip(infos, reference, strict=True):
        assert info.logprob is not None and len(info.candidates) == TOP_N
        worst = max(worst, abs(info.logprob - row[info.token_id].item()))
        # The first candidate is the engine's most likely token: it must be the oracle's max.
        worst = max(worst, abs(info.candidates[0].logprob - row.max().item()))
        for cand in info.candidates:
            worst = max(worst, abs(cand.logprob - row[cand.token_id].item()))
    return worst


ALL_MODELS = [pytest.param(BASE, id="base"), *ADAPTERS]


@pytest.mark.parametrize("model", ALL_MODELS)
def test_matches_peft(engine, oracle, prompt_ids, alone, model) -> None:
    for p in prompts_for(model):
        prompt, generated = prompt_ids[p], alone[model, p].outputs[0].token_ids
        seq = prompt + generated
        reference = torch.log_softmax(oracle.logits(model, seq), dim=-1)  # row i predicts seq[i + 1]
        n = len(prompt)

        oracle_argmax = reference[n - 1:-1].argmax(dim=-1).tolist()
        if generated != oracle_argmax:
            i = next(i for i, (a, b) in enumerate(zip(generated, oracle_argmax, strict=True)) if a != b)
            top2 = reference[n - 1 + i].topk(2).values.tolist()
            pytest.fail(f"{model} on prompt {p}: engine greedy {generated} is not PEFT's {oracle_argmax}: first "
                        f"difference at output position {i}, where PEFT's top two log-probs are {top2}")

        if p == prompts_for(model)[0]:  # and once per model, PEFT's own greedy decoding with its KV cache
            assert oracle.greedy(model, prompt, NUM_TOKENS) == generated, f"{model} on prompt {p}"

        decode_error = logprob_errors(alone[model, p].outputs[0].tokens, reference[n - 1:-1])
        assert decode_error <= TOL, f"{model} on prompt {p}: output log-probs differ from PEFT by {decode_error}"

        (scored,) = engine.run_until_done([scoring_request(f"score-{rid_of(model, p)}", model, seq)])
        assert scored.prompt_tokens is not None and len(scored.prompt_tokens) == len(seq)
        assert scored.prompt_tokens[0].logprob is None
        assert [t.token_id for t in scored.prompt_tokens] == seq
        prefill_error = logprob_errors(scored.prompt_tokens[1:], reference[:-1])
        assert prefill_error <= TOL, f"{model} on prompt {p}: prompt log-probs differ from PEFT by {prefill_error}"
        # The whole vocabulary at the position after the sequence.
        (last,) = scored.outputs[0].tokens
        ids = torch.tensor([c.token_id for c in last.candidates])
        assert ids.sort().values.equal(torch.arange(reference.shape[1])), "candidates 'all' must be the vocabulary"
        full_error = (torch.tensor([c.logprob for c in last.candidates]) - reference[-1, ids]).abs().max().item()
        assert full_error <= TOL, f"{model} on prompt {p}: next-token log-probs differ from PEFT by {full_error}"
    assert_idle(engine)


def test_adapters_change_the_output(alone, oracle, prompt_ids) -> None:
    """Not vacuous: every adapter moves the greedy output (on at least one of its prompts, and
    on most pairs) and the distribution, while the logits stay in the base model's range."""
    changed = []
    for name in ADAPTERS:
        per_prompt = [alone[name, p].outputs[0].token_ids != alone[BASE, p].outputs[0].token_ids
                      for p in prompts_for(name)]
        assert any(per_prompt), f"adapter {name} leaves the greedy output of both its prompts unchanged"
        changed += per_prompt
        p = prompts_for(name)[0]
        with_adapter, base = oracle.logits(name, prompt_ids[p]), oracle.logits(BASE, prompt_ids[p])
        shift = (torch.log_softmax(with_adapter, -1) - torch.log_softmax(base, -1)).abs().max().item()
        assert shift > 0.5, f"adapter {name} barely moves the log-probs (max shift {shift})"
        assert with_adapter.abs().max() < 4 * base.abs().max(), f"adapter {name} makes the logits blow up"
    assert sum(changed) >= 0.75 * len(changed), f"only {sum(changed)} of {len(changed)} runs changed"


def batch_requests(prompt_ids) -> list[tuple[tuple[str | None, int], GenerationRequest]]:
    keys = [(model, p) for model in (*BATCH_ADAPTERS, BASE) for p in prompts_for(model)]
    return [(key, greedy_request(f"batch-{rid_of(*key)}", key[0], prompt_ids[key[1]])) for key in keys]


def assert_batch_matches_alone(engine: Engine, prompt_ids, alone) -> list[Completion]:
    items = batch_requests(prompt_ids)
    results = engine.run_until_done([request for _, request in items])
    for (key, _), completion in zip(items, results, strict=True):
        assert completion.error is None, completion.error
        got, want = completion.outputs[0].token_ids, alone[key].outputs[0].token_ids
        assert got == want, f"{rid_of(*key)}: batched {got} != alone {want}"
        got_lp = [t.logprob for t in completion.outputs[0].tokens]
        want_lp = [t.logprob for t in alone[key].outputs[0].tokens]
        assert max(abs(a - b) for a, b in zip(got_lp, want_lp, strict=True)) <= TOL
    assert_idle(engine)
    return results


def test_mixed_batch_with_all_adapters_resident(engine, prompt_ids, alone, monkeypatch) -> None:
    steps = record_step_adapters(engine, monkeypatch)
    results = assert_batch_matches_alone(engine, prompt_ids, alone)
    assert max(len(s) for s in steps) == len(BATCH_ADAPTERS), "the four adapters were meant to run in one step"
    # The lone runs cached each (adapter, prompt)'s full blocks; the batch reuses them.
    assert all(r.usage.cached_prompt_tokens >= 16 for r in results)


def test_mixed_batch_swapping_adapters_through_two_slots(model_parts, adapter_root, adapter_dirs, prompt_ids,
                                                         alone, monkeypatch) -> None:
    engine = make_engine(model_parts, adapter_root, max_loras=2)
    load_adapters(engine, adapter_dirs, BATCH_ADAPTERS)
    steps = record_step_adapters(engine, monkeypatch)
    results = assert_batch_matches_alone(engine, prompt_ids, alone)
    assert max(len(s) for s in steps) == 2, "at most two adapters per step, and some step uses two"
    # Four adapters ran through two slots: each was copied into a slot another had held.
    assert len(set().union(*steps)) == len(BATCH_ADAPTERS) > 2
    # A fresh engine: a prompt's blocks may only be reused under the adapter that computed them,
    # so the only hits are none at all here (each (adapter, prompt) pair appears once).
    assert all(r.usage.cached_prompt_tokens == 0 for r in results)
