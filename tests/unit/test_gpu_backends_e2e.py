"""End-to-end greedy decoding on CUDA across the attention backends (torch reference, Triton,
FlashInfer) and with and without decode CUDA graphs (``@pytest.mark.gpu``; skipped without CUDA,
and per backend where it is unavailable, with the registry's reason).

The model is a small random Llama (4 layers, 8 query / 2 KV heads of 64; its GQA group of 4 takes
FlashInfer's CUDA-core decode) run through ``ModelRunner`` on a ragged batch: prefill, then 16
decode steps. SmolLM2 is not used here: its 94 MB GGUF cannot be carried to the GPU machine.

Agreement, as documented in the README's GPU section:
- with and without graphs, one backend: the same tokens, bit for bit, for the torch reference and
  Triton (their graphs compute the eager decode step; Triton's are captured unsplit and the
  contexts here are too short for the eager path to split). FlashInfer's graph-mode and eager
  planners may split the KV differently, so it is held to the rule below instead;
- across backends, and for FlashInfer's graphs: each run's tokens equal the torch reference's
  eager run until its first difference, if any, and there the token it chose is within
  ``MARGIN[dtype]`` of the reference's best logit at that step (a near-tie, not an error).
"""

from __future__ import annotations

import pytest
import torch

from refengine.config import CacheConfig, KernelConfig
from refengine.kernels.attention import registry
from refengine.model.runner import ModelRunner
from tests.tiny_models import hf_weights, make_tiny_hf_model, model_config_from_hf
from tests.unit.test_cuda_graphs import make_step

CUDA = torch.cuda.is_available()
BLOCK = 4  # make_step's layout: sequence i owns blocks 8i .. 8i+7
MAX_LEN = 32
DECODE_STEPS = 16
PROMPT_LENS = [1, 3, 6, 9, 2]
#: How far below the reference's best logit a diverging run's token may be.
MARGIN = {torch.float32: 1e-4, torch.bfloat16: 0.1}
BIT_IDENTICAL_GRAPHS = ("torch", "triton")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device (torch.cuda.is_available() "
                                                                  "is False): these compare the GPU backends")]


@pytest.fixture(scope="module")
def model():
    hf = make_tiny_hf_model(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=MAX_LEN)
    return model_config_from_hf(hf), hf_weights(hf)


def greedy(model, backend: str, dtype: torch.dtype, graphs: bool) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Per step: every sequence's greedy token, and the step's logits ``[seqs, vocab]``."""
    model_config, weights = model
    kernels = KernelConfig(cuda_graphs=graphs)
    attention = registry.make_attention_backend(backend, dtype, "cuda", kernels)
    runner = ModelRunner(model_config, weights, CacheConfig(block_size=BLOCK, num_blocks=64), MAX_LEN, dtype=dtype,
                         device="cuda", attention=attention, kernels=kernels, max_num_seqs=8)
    assert (runner.graphs is not None) == graphs, runner.graphs_unavailable
    prompts = [[3 + (7 * i + j) % 500 for j in range(n)] for i, n in enumerate(PROMPT_LENS)]
    logits = runner.execute(make_step([(0, p) for p in prompts]))
    steps, all_logits, lens = [logits.argmax(-1).tolist()], [logits], list(PROMPT_LENS)
    for _ in range(DECODE_STEPS):
        logits = runner.execute(make_step([(n, [t]) for n, t in zip(lens, steps[-1], strict=True)]))
        lens = [n + 1 for n in lens]
        steps.append(logits.argmax(-1).tolist())
        all_logits.append(logits)
    if graphs:
        assert runner.graphs.num_replays >= DECODE_STEPS
    return steps, all_logits


def assert_agrees(reference: tuple[list[list[int]], list[torch.Tensor]], run: list[list[int]], margin: float) -> None:
    """Per sequence: equal tokens until the first difference; there, a near-tie in the reference."""
    ref_steps, ref_logits = reference
    for seq in range(len(PROMPT_LENS)):
        for step, (want, got) in enumerate(zip(ref_steps, run, strict=True)):
            if want[seq] != got[seq]:
                row = ref_logits[step][seq]
                gap = float(row[want[seq]] - row[got[seq]])
                assert gap <= margin, f"sequence {seq}, step {step}: token {got[seq]} is {gap:.3g} below the best"
                break


def available(backend: str, dtype: torch.dtype) -> None:
    if reason := registry.unavailable_reason(backend, dtype, "cuda", KernelConfig()):
        pytest.skip(f"{backend} cannot run here: {reason}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["torch", "triton", "flashinfer"])
def test_greedy_tokens_across_backends_and_graphs(model, backend: str, dtype: torch.dtype) -> None:
    available(backend, dtype)
    reference = greedy(model, "torch", dtype, graphs=False)
    eager = greedy(model, backend, dtype, graphs=False)
    graphed = greedy(model, backend, dtype, graphs=True)
    assert_agrees(reference, eager[0], MARGIN[dtype])
    if backend in BIT_IDENTICAL_GRAPHS:
        assert graphed[0] == eager[0], "graphs changed a greedy token"
    else:
        assert_agrees(eager, graphed[0], MARGIN[dtype])
