"""On-device sampling (``KernelConfig.device_sampling``, ``--no-device-sampling``).

On a GPU the step's logits stay on it and the sampler runs there. Only the per-row uniforms
(drawn from the requests' CPU generators) go over, and only the chosen ids come back. The
sampler's semantics do not depend on where it runs: the same engine with and without device
sampling produces the same tokens (greedy, seeded, truncated, penalized, guided) and the same
logprobs. Those tests need CUDA; on the CPU the logits already live where the sampler runs, and
the tests here show the engine never asks for them elsewhere.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from refengine.config import CacheConfig, EngineConfig, KernelConfig, SchedulerConfig
from refengine.engine.engine import Engine
from refengine.types import GenerationRequest, GuidedSpec, LogprobParams, SamplingParams, StoppingParams
from tests.tiny_models import hf_weights, make_tiny_hf_model, model_config_from_hf
from tests.unit.tokenizer_fixture import byte_fallback_tokenizer

CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False): on the CPU the logits are already on the host"


def make_engine(device: str, device_sampling: bool) -> Engine:
    tokenizer = byte_fallback_tokenizer()
    model = make_tiny_hf_model(vocab_size=len(tokenizer), max_position_embeddings=128)
    return Engine(EngineConfig(device=device, attention_backend="torch", max_model_len=128,
                               max_sequences_per_request=4, kernels=KernelConfig(device_sampling=device_sampling),
                               cache=CacheConfig(block_size=4, num_blocks=256),
                               scheduler=SchedulerConfig(max_num_seqs=16)),
                  model_config_from_hf(model), hf_weights(model), tokenizer, model_fingerprint="tiny")


def requests(vocab_size: int) -> list[GenerationRequest]:
    """Greedy, seeded sampling with every truncation and penalty, n = 3, logprobs, and JSON-guided."""
    prompts = [[3 + (11 * i + j) % (vocab_size - 3) for j in range(3 + 4 * i)] for i in range(6)]
    stop = StoppingParams(max_tokens=16, ignore_eos=True)
    logprobs = LogprobParams(output_logprobs=True)
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    return [
        GenerationRequest("greedy", prompt_token_ids=prompts[0], sampling=SamplingParams(temperature=0.0),
                          stopping=stop, logprobs=logprobs),
        GenerationRequest("seeded", prompt_token_ids=prompts[1], stopping=stop, logprobs=logprobs,
                          sampling=SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.02, seed=7)),
        GenerationRequest("penalized", prompt_token_ids=prompts[2], stopping=stop,
                          sampling=SamplingParams(temperature=1.0, seed=8, repetition_penalty=1.3,
                                                  frequency_penalty=0.5, presence_penalty=0.4)),
        GenerationRequest("three", prompt_token_ids=prompts[3], stopping=stop,
                          sampling=SamplingParams(temperature=1.0, seed=9, num_sequences=3)),
        GenerationRequest("guided", prompt_token_ids=prompts[4], stopping=StoppingParams(max_tokens=24),
                          sampling=SamplingParams(temperature=0.7, seed=10),
                          guided=GuidedSpec("json_schema", schema)),
    ]


def outcome(engine: Engine) -> Iterator[tuple[str, int, list[int], list[float | None]]]:
    vocab = engine.core.sampler.vocab_size
    for result in engine.run_until_done(requests(vocab)):
        for index, output in enumerate(result.outputs):
            yield result.request_id, index, output.token_ids, [t.logprob for t in output.tokens]


def test_on_the_cpu_the_engine_asks_for_host_logits() -> None:
    engine = make_engine("cpu", device_sampling=True)
    assert engine.core.logits_on_device is False
    seen: list[bool] = []
    execute = engine.core.runner.execute

    def spy(model_input, *, logits_on_device: bool = False):  # noqa: ANN001, ANN202
        seen.append(logits_on_device)
        return execute(model_input, logits_on_device=logits_on_device)

    engine.core.runner.execute = spy
    assert len(list(outcome(engine))) == 7
    assert seen and not any(seen)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
def test_the_same_tokens_sampled_on_the_gpu_and_on_the_host() -> None:
    on_device, on_host = make_engine("cuda", True), make_engine("cuda", False)
    assert (on_device.core.logits_on_device, on_host.core.logits_on_device) == (True, False)
    devices: list[str] = []
    execute = on_device.core.runner.execute

    def spy(model_input, *, logits_on_device: bool = False):  # noqa: ANN001, ANN202
        logits = execute(model_input, logits_on_device=logits_on_device)
        if logits is not None:
            devices.append(logits.device.type)
        return logits

    on_device.core.runner.execute = spy
    got, want = list(outcome(on_device)), list(outcome(on_host))
    assert devices and set(devices) == {"cuda"}  # no step copied its logits to the host
    for (rid, index, tokens, logprobs), (_, _, want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens, f"{rid}[{index}]"
        for a, b in zip(logprobs, want_logprobs, strict=True):
            assert (a is None) == (b is None) and (a is None or abs(a - b) <= 1e-5), f"{rid}[{index}]"
