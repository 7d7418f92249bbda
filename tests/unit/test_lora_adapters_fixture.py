"""The test-side adapter builder (``tests/lora_adapters.py``): its ``seed`` must choose the weights,
or two adapters a test builds as different are byte-identical (and so share prefix-cache keys)."""

from __future__ import annotations

from pathlib import Path

from tests.lora_adapters import make_peft_adapter
from tests.tiny_models import make_tiny_hf_model


def test_different_seeds_give_different_adapter_files(tmp_path: Path) -> None:
    model = make_tiny_hf_model(vocab_size=64, max_position_embeddings=32)
    made = [make_peft_adapter(model, tmp_path / str(seed), 4, ["q_proj"], seed=seed) for seed in (1, 2, 1)]
    weights = [(path / "adapter_model.safetensors").read_bytes() for path in made]
    assert weights[0] != weights[1]
    assert weights[0] == weights[2]  # still reproducible
