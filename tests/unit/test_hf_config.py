"""config.json as transformers reads it: omitted keys take the defaults of transformers' config
class for the model type, llama3 RoPE takes transformers' defaults and precedence, and a config's
max_position_embeddings never sizes an allocation past what the KV pool can serve."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers

from refengine.config import CacheConfig
from refengine.model import UnsupportedModelError, load_model_config, load_weights
from refengine.model.runner import ModelRunner
from refengine.scheduler.sequence import Sequence
from tests.step_helpers import run_step
from tests.unit.test_loader import save_model, tiny_model

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def edit_config(directory: Path, drop: tuple[str, ...] = (), **changes: object) -> dict:
    path = directory / "config.json"
    config = {k: v for k, v in json.loads(path.read_text()).items() if k not in drop} | changes
    path.write_text(json.dumps(config))
    return config


def logits_of(directory: Path, ids: list[int]) -> torch.Tensor:
    """refengine's logits for every position of ``ids``, one prefill step."""
    runner = ModelRunner(load_model_config(directory), load_weights(directory),
                         CacheConfig(block_size=16, num_blocks=32), 256)
    seq = Sequence("g", 0, list(ids), len(ids))
    seq.block_table = list(range(-(-len(ids) // 16)))
    return run_step(runner, seq, len(ids), all_logits=True)


def test_a_mistral_config_without_sliding_window_gets_transformers_default(tmp_path: Path) -> None:
    """MistralConfig's default window (4096) applies when config.json omits the key, as in transformers."""
    directory = save_model(tiny_model("mistral", max_position_embeddings=8192), tmp_path / "m")
    edit_config(directory, drop=("sliding_window",))
    window = transformers.AutoConfig.from_pretrained(directory).sliding_window
    assert window == 4096
    assert load_model_config(directory).max_position_embeddings == window  # capped at the window


def test_a_llava_text_config_saved_as_a_diff_gets_llama_defaults(tmp_path: Path) -> None:
    """llava-1.5's text_config lists only what differs from LlamaConfig: the rest is LlamaConfig's defaults."""
    text = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096, "model_type": "llama",
            "rms_norm_eps": 1e-05, "vocab_size": 32064}
    vision = {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096, "model_type": "clip_vision_model",
              "num_attention_heads": 16, "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768}
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "text_config": text,
        "vision_config": vision, "tie_word_embeddings": False, "image_token_index": 32000}))
    want = transformers.AutoConfig.from_pretrained(tmp_path).text_config
    got = load_model_config(tmp_path)
    assert (got.hidden_size, got.intermediate_size, got.num_hidden_layers) == (4096, 11008, 32)
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size", "rms_norm_eps"):
        assert getattr(got, field) == getattr(want, field), field


@pytest.mark.parametrize(("inner", "top", "used"), [(None, None, 256), (128, 32, 32), (128, None, 128)],
                         ids=["default", "top-level-wins", "inner"])
def test_llama3_original_max_positions_follow_transformers(tmp_path: Path, inner: int | None, top: int | None,
                                                           used: int) -> None:
    """A missing original_max_position_embeddings is max_position_embeddings; a top-level one wins over
    the one in rope_parameters; the logits match transformers' in each case."""
    directory = save_model(tiny_model(rope_scaling=LLAMA3 | {"original_max_position_embeddings": 64}), tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    rope = {k: v for k, v in config["rope_parameters"].items() if k != "original_max_position_embeddings"}
    if inner is not None:
        rope["original_max_position_embeddings"] = inner
    edit_config(directory, rope_parameters=rope, **({} if top is None else {"original_max_position_embeddings": top}))
    assert load_model_config(directory).rope_scaling["original_max_position_embeddings"] == used
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory).float().eval()
    assert reference.config.rope_parameters["original_max_position_embeddings"] == used
    ids = torch.randint(3, 60, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits_of(directory, ids), want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("missing", ["factor", "low_freq_factor", "high_freq_factor"])
def test_llama3_missing_a_key_is_refused_as_transformers_refuses_it(tmp_path: Path, missing: str) -> None:
    """llama3 RoPE scaling without one of its keys is an UnsupportedModelError naming the key, not a
    KeyError at model build, and not a guessed default: transformers refuses the same file (before,
    the two frequency factors defaulted to 1 and 4, so a config transformers cannot load was served)."""
    directory = save_model(tiny_model(), tmp_path / "m")
    rope = {"rope_theta": 10000.0, "original_max_position_embeddings": 64} | LLAMA3
    del rope[missing]
    edit_config(directory, rope_parameters=rope)
    with pytest.raises(KeyError, match=missing):  # the oracle
        transformers.AutoConfig.from_pretrained(directory)
    with pytest.raises(UnsupportedModelError, match=rf"config\.json: .*llama3 RoPE scaling needs {missing}"):
        load_model_config(directory)


@pytest.mark.parametrize(("key", "value"), [("factor", 0), ("low_freq_factor", -1.0), ("high_freq_factor", "4"),
                                            ("original_max_position_embeddings", True)])
def test_llama3_keys_that_are_not_positive_numbers_are_refused(tmp_path: Path, key: str, value: object) -> None:
    """They would divide by zero or flip the blend; transformers only warns, and builds tables of inf/nan."""
    directory = save_model(tiny_model(), tmp_path / "m")
    edit_config(directory, rope_parameters={"rope_theta": 10000.0, "original_max_position_embeddings": 64}
                | LLAMA3 | {key: value})
    with pytest.raises(UnsupportedModelError, match="must be positive numbers"):
        load_model_config(directory)


def test_rope_tables_stop_at_what_the_kv_pool_serves(tmp_path: Path) -> None:
    """A config claiming 2**40 positions builds RoPE tables for the pool's 64 tokens, not for 2**40
    (which raised an allocator error; 8e6 took 1.3 GB for a 130 KB model)."""
    directory = save_model(tiny_model(), tmp_path / "m")
    edit_config(directory, max_position_embeddings=2**40)
    config = load_model_config(directory)
    runner = ModelRunner(config, load_weights(directory), CacheConfig(block_size=16, num_blocks=4),
                         config.max_position_embeddings)
    assert runner.model.rope.cos.shape[0] == runner.model.rope.signed_sin.shape[0] == 64


def test_a_bos_outside_the_vocabulary_is_ignored(tmp_path: Path) -> None:
    """Found by review: transformers only warns on it, refengine kept it, and the health probe
    (whose prompt is the BOS) was refused as a request every time, leaving the server DEGRADED."""
    model_dir = save_model(tiny_model(), tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"bos_token_id": config["vocab_size"]}))
    assert load_model_config(model_dir).bos_token_id is None


@pytest.mark.parametrize(("field", "text"), [("rope_theta", "0"), ("rope_theta", "Infinity"),
                                             ("rms_norm_eps", "Infinity")])
def test_a_zero_or_infinite_rope_theta_or_norm_eps_is_refused(tmp_path: Path, field: str, text: str) -> None:
    """Found by review: Python's JSON reads Infinity; an infinite eps loaded and then every request
    failed ('logits are not finite'), and a rope_theta of 0 was served as 10000 (``or`` fell through)."""
    model_dir = save_model(tiny_model(), tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("rope_parameters", None)
    (model_dir / "config.json").write_text(json.dumps(config | {field: "VALUE"}).replace('"VALUE"', text))
    with pytest.raises(UnsupportedModelError, match=rf"{field} must be a finite number > 0"):
        load_model_config(model_dir)
