"""Our GGUF conversion of SmolLM2 against transformers' own GGUF loading.

transformers dequantizes the same file with the same ``gguf`` routines and undoes
llama.cpp's q/k permutation its own way, so every parameter must agree; the tokenizer
it builds from the GGUF must encode exactly like the one we saved.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from refengine.model import load_model_config, load_tokenizer, load_weights

pytestmark = pytest.mark.golden

SAMPLES = [
    "Hello, world!",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "naïve café — Größe, 東京, Привет, 🚀👍🏽 🇫🇷",
    "def f(x):\n    return x ** 2  # comment",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
]
QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def hf_from_gguf(smollm2_gguf: Path) -> transformers.PreTrainedModel:
    """transformers loading the GGUF itself (~25 s on 2 CPU cores; once per module)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32, local_files_only=True
    )
    return model.eval()


@pytest.fixture(scope="module")
def gguf_tokenizer(smollm2_gguf: Path) -> transformers.PreTrainedTokenizerFast:
    return transformers.AutoTokenizer.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, local_files_only=True
    )


def test_every_parameter_matches_transformers(smollm2_dir: Path, hf_from_gguf) -> None:
    ours = load_weights(smollm2_dir)
    theirs = {k: v.detach() for k, v in hf_from_gguf.state_dict().items()}
    assert hf_from_gguf.config.tie_word_embeddings
    assert set(theirs) - set(ours) == {"lm_head.weight"}  # tied: we keep the embedding only
    assert set(ours) <= set(theirs)
    theirs["lm_head.weight"] = theirs["model.embed_tokens.weight"]
    for name, tensor in theirs.items():
        mine = ours["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        assert mine.shape == tensor.shape, name
        worst = (mine - tensor).abs().max().item()  # torch.allclose is ~10x slower here
        assert worst <= 1e-6, (name, worst)


def test_config_matches_transformers(smollm2_dir: Path, hf_from_gguf) -> None:
    config, theirs = load_model_config(smollm2_dir), hf_from_gguf.config
    assert config.architecture == "LlamaForCausalLM"
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
        assert getattr(config, field) == getattr(theirs, field), field
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.num_key_value_heads == theirs.num_key_value_heads
    assert config.max_position_embeddings == theirs.max_position_embeddings == 8192
    assert config.rope_theta == theirs.rope_parameters["rope_theta"] == 100000.0
    assert config.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)
    assert config.tie_word_embeddings and config.rope_scaling is None
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))


def test_same_logits_as_transformers_gguf(hf_smollm2, hf_from_gguf) -> None:
    """The config we wrote makes transformers build the same network as from the GGUF."""
    ids = torch.tensor([[1, 9690, 198, 2683, 314, 253, 5356, 30, 2]])
    with torch.no_grad():
        ours, theirs = hf_smollm2(ids).logits, hf_from_gguf(ids).logits
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-4), (ours - theirs).abs().max()


def test_tokenizer_matches_transformers(smollm2_dir: Path, gguf_tokenizer) -> None:
    ours = load_tokenizer(smollm2_dir)
    assert isinstance(ours, transformers.PreTrainedTokenizerFast)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)
    theirs = gguf_tokenizer
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert len(ours) == len(gguf_tokenizer) == 49152
    for text in SAMPLES:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == gguf_tokenizer.encode(text, add_special_tokens=special), text
        assert ours.decode(ours.encode(text, add_special_tokens=False)) == text

    assert ours.chat_template is not None and ours.chat_template == gguf_tokenizer.chat_template
    messages = [{"role": "user", "content": "Héllo 👋"}, {"role": "assistant", "content": "Hi!"}]
    text = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == gguf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)


def test_greedy_answer_names_paris(smollm2_dir: Path, hf_smollm2) -> None:
    tokenizer = load_tokenizer(smollm2_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        out = hf_smollm2.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=2, pad_token_id=2)
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
