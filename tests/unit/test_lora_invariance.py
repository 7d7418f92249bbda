"""G18 under an adapter: a LoRA request's greedy tokens and their logprobs are bit-identical
whatever its chunking and whatever shares its steps (float32, CPU). A step with more than 256
adapter tokens took the torch matmuls, which round by the step's shape; only steps of up to 256
took the per-token native kernel, so a 300-token prompt prefilled in one chunk differed from the
same prompt in chunks of 64 (by up to 9.5e-7 in a logprob; found by review)."""

from __future__ import annotations

from pathlib import Path

import pytest

from refengine.config import CacheConfig, EngineConfig, LoraConfig, SchedulerConfig
from refengine.engine.engine import Engine
from refengine.kernels.lora_native import native_lora_available
from refengine.types import GenerationRequest, LogprobParams, LoraAdapterSpec, SamplingParams, StoppingParams
from tests.tiny_models import hf_weights, make_tiny_hf_model, model_config_from_hf
from tests.unit.test_lora_engine import make_adapter
from tests.unit.tokenizer_fixture import byte_fallback_tokenizer

TOKENIZER = byte_fallback_tokenizer()
PROMPT = [5 + (7 * j * j + 3 * j) % 200 for j in range(300)]
COMPANIONS = [([9 + (5 * j) % 190 for j in range(40)], "b"), ([4 + j % 100 for j in range(20)], None)]


def request(rid: str, ids: list[int], lora: str | None) -> GenerationRequest:
    return GenerationRequest(rid, prompt_token_ids=ids, sampling=SamplingParams(temperature=0.0),
                             stopping=StoppingParams(max_tokens=6, ignore_eos=True), lora_name=lora,
                             logprobs=LogprobParams(output_logprobs=True))


@pytest.mark.skipif(not native_lora_available(), reason="the native LoRA kernel did not build here (no C compiler)")
def test_a_long_lora_prompt_is_batch_and_chunk_invariant(tmp_path: Path) -> None:
    model = make_tiny_hf_model(vocab_size=len(TOKENIZER), max_position_embeddings=1024)
    config, weights = model_config_from_hf(model), hf_weights(model)
    make_adapter(model, tmp_path / "a", 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj"], seed=1)
    make_adapter(model, tmp_path / "b", 16, ["q_proj", "v_proj", "o_proj"], seed=2)

    def run(budget: int, companions: list) -> tuple[list[int], list[float]]:
        engine = Engine(EngineConfig(max_model_len=512, cache=CacheConfig(block_size=16, num_blocks=128),
                                     scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16),
                                     lora=LoraConfig(enabled=True, roots=(str(tmp_path),), max_loras=2)),
                        config, weights, TOKENIZER, model_fingerprint="tiny")
        engine.load_lora(LoraAdapterSpec(1, "a", str(tmp_path / "a")))
        engine.load_lora(LoraAdapterSpec(2, "b", str(tmp_path / "b")))
        reqs = [request("main", PROMPT, "a")] + [request(f"c{i}", p, lora) for i, (p, lora) in enumerate(companions)]
        out = engine.run_until_done(reqs)[0].outputs[0]
        return [t.token_id for t in out.tokens], [t.logprob for t in out.tokens]

    alone = run(512, [])  # one 300-token step
    assert run(64, []) == alone  # five chunks
    assert run(100, COMPANIONS) == alone  # chunks beside other adapters' requests
