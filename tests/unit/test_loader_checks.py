"""Model loading refuses what it cannot serve, naming the file and the field, before any request runs.

Tensors are checked against config.json (a contradicting ``head_dim`` used to load and then
corrupt the heap in the native attention kernel; a smaller ``vocab_size`` silently truncated
the vocabulary); malformed config files give UnsupportedModelError, not KeyError/TypeError;
an index cannot name shards outside the model directory; a tied head that differs from the
embeddings is kept, as transformers 5 does (the oracle); the tokenizer never runs code from
the model directory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from refengine.model import UnsupportedModelError, load_model_config, load_tokenizer, load_weights, loader
from refengine.model.loader import model_fingerprint
from tests.unit.test_loader import save_model, tiny_model


def edit_config(directory: Path, **changes: object) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return save_model(tiny_model(), tmp_path / "m")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"head_dim": 16}, r"q_proj\.weight has shape \[32, 32\] but config\.json implies \[64, 32\].*head_dim=16"),
        ({"vocab_size": 100}, r"embed_tokens\.weight has shape \[\d+, 32\] but config\.json implies \[100, 32\]"),
        ({"vocab_size": 4096}, r"embed_tokens\.weight has shape \[\d+, 32\] but config\.json implies \[4096, 32\]"),
        ({"num_key_value_heads": 4}, r"k_proj\.weight has shape \[16, 32\] but config\.json implies \[32, 32\]"),
        ({"intermediate_size": 64}, r"gate_proj\.weight has shape \[48, 32\] but config\.json implies \[64, 32\]"),
        ({"num_hidden_layers": 3}, r"the weights lack model\.layers\.2\."),
    ],
)
def test_weights_that_contradict_config_json_are_refused(model_dir: Path, changes: dict, message: str) -> None:
    edit_config(model_dir, **changes)
    with pytest.raises(UnsupportedModelError, match=message):
        load_weights(model_dir)


def test_a_missing_tensor_is_named(model_dir: Path) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=r"lack model\.layers\.1\.mlp\.down_proj\.weight"):
        load_weights(model_dir)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "config.json is not valid UTF-8 JSON"),
        ("[1, 2]", "config.json must hold a JSON object, not list"),
        (None, "config.json: required field 'text_config' is missing"),
        ({"hidden_size": "wide"}, "config.json: "),
        ({"num_attention_heads": 0, "head_dim": None}, "config.json: "),
        ({"text_config": 3, "architectures": ["LlavaForConditionalGeneration"]}, "config.json: "),
        ({"num_hidden_layers": -1}, "config.json: ModelConfig.num_hidden_layers"),
    ],
)
def test_malformed_config_json_names_the_file(model_dir: Path, text: object, message: str) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    if text is None:  # every other field has a transformers default (test_hf_config)
        path.write_text(json.dumps(config | {"architectures": ["LlavaForConditionalGeneration"]}))
    elif isinstance(text, dict):
        path.write_text(json.dumps(config | text))
    else:
        path.write_text(text)
    with pytest.raises(UnsupportedModelError, match=message):
        load_model_config(model_dir)


def test_non_utf8_config_is_refused(model_dir: Path) -> None:
    (model_dir / "config.json").write_bytes(b'{"vocab_size": "\xff"}')
    with pytest.raises(UnsupportedModelError, match="not valid UTF-8 JSON"):
        load_model_config(model_dir)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/tmp/outside.safetensors", "weights.bin"])
def test_index_shards_stay_inside_the_model_directory(tmp_path: Path, shard: str) -> None:
    directory = save_model(tiny_model(), tmp_path / "m", max_shard_size="20KB")
    index = directory / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    first = next(iter(content["weight_map"]))
    content["weight_map"][first] = shard
    index.write_text(json.dumps(content))
    with pytest.raises(UnsupportedModelError, match=f"shard {shard!r} is not a .safetensors file in the model"):
        load_weights(directory)


def test_a_tied_head_that_differs_from_the_embeddings_is_kept_as_transformers_does(tmp_path: Path) -> None:
    directory = save_model(tiny_model(tie=True), tmp_path / "tied")
    path = directory / "model.safetensors"
    tensors = load_file(path)
    torch.manual_seed(1)
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, path, metadata={"format": "pt"})

    theirs = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    ours = load_weights(directory)
    assert torch.equal(ours["lm_head.weight"], theirs.lm_head.weight.detach())
    assert torch.equal(ours["model.embed_tokens.weight"], theirs.model.embed_tokens.weight.detach())

    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()  # an equal copy: dropped
    save_file(tensors, path, metadata={"format": "pt"})
    assert "lm_head.weight" not in load_weights(directory)


def test_the_tokenizer_never_runs_code_from_the_model_directory(model_dir: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (model_dir / "custom_tok.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class CustomTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config |= {"tokenizer_class": "CustomTokenizer",
               "auto_map": {"AutoTokenizer": [None, "custom_tok.CustomTokenizer"]}}
    config_path.write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="cannot load the tokenizer.*custom code"):
        load_tokenizer(model_dir)  # before: transformers asked on stdin whether to run it
    assert not marker.exists()


def test_a_malformed_tokenizer_json_is_refused(model_dir: Path) -> None:
    (model_dir / "tokenizer.json").write_text('{"model": {"type": "nonsense"}}')
    with pytest.raises(UnsupportedModelError, match="cannot load the tokenizer"):
        load_tokenizer(model_dir)


def _remove_a_shard(directory: Path) -> Path:
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    shard.unlink()
    return shard


def _garble(directory: Path) -> Path:
    path = directory / "model-00001-of-00006.safetensors"
    path.write_bytes(b"\0" * 100)
    return path


def _truncate(directory: Path) -> Path:
    path = directory / "model-00001-of-00006.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    return path


def _config_dir(directory: Path) -> Path:
    path = directory / "config.json"
    path.unlink()
    path.mkdir()
    return path


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_remove_a_shard, "cannot read the weights: No such file"),
        (_garble, "cannot read the weights: Error while deserializing header"),
        (_truncate, "cannot read the weights: .*incomplete metadata"),
        (_config_dir, "cannot read .*config.json: .*Is a directory"),
    ],
    ids=["missing-shard", "garbage", "truncated", "config-is-a-directory"],
)
def test_unreadable_weight_files_are_named(tmp_path: Path, damage: Callable[[Path], Path], message: str) -> None:
    """A missing shard, a garbage or truncated safetensors file, or a config.json that is a directory:
    UnsupportedModelError naming the file, not FileNotFoundError/SafetensorError/IsADirectoryError."""
    directory = save_model(tiny_model(), tmp_path / "m", max_shard_size="20KB")
    assert len(list(directory.glob("model-*-of-00006.safetensors"))) == 6
    path = damage(directory)
    with pytest.raises(UnsupportedModelError, match=message) as raised:
        load_weights(directory)
    assert str(path) in str(raised.value)


def test_the_fingerprint_covers_the_weights_not_only_their_shapes(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Same config and shapes, other weights (another fine-tune): another fingerprint, since equal
    fingerprints must mean equal KV. Also where a large file is only sampled (header + windows)."""
    a = save_model(tiny_model(), tmp_path / "a")
    other = tiny_model()
    with torch.no_grad():
        for param in other.parameters():
            param.mul_(-1.0)
    b = save_model(other, tmp_path / "b")
    same = save_model(tiny_model(), tmp_path / "same")
    assert model_fingerprint(a) != model_fingerprint(b)
    assert model_fingerprint(a) == model_fingerprint(same)
    monkeypatch.setattr(loader, "FINGERPRINT_WHOLE_FILE_BYTES", 0)  # the path of files over 64 MiB
    assert model_fingerprint(a) != model_fingerprint(b)
    assert model_fingerprint(a) == model_fingerprint(same)
    # The same weights run in another dtype compute other KV (a prefill in bfloat16 and a decode in
    # float32 with float32 caches passed the KV check before).
    assert model_fingerprint(a, "bfloat16") != model_fingerprint(a, "float32") != model_fingerprint(a)
    # And in a KV cache of another dtype (found by review); the compute dtype's own adds nothing.
    assert model_fingerprint(a, "float32", "bfloat16") != model_fingerprint(a, "float32")
    assert model_fingerprint(a, "float32", "float32") == model_fingerprint(a, "float32")


def test_an_engine_keys_its_blocks_by_its_kv_cache_dtype_too() -> None:
    """The engine passes its KV cache's dtype to the fingerprint (its prefix-cache keys, its KV
    events' hashes, a decode engine's check of a prefill's KV): float32 compute on a bfloat16
    cache keys other blocks than on a float32 one (found by review)."""
    from refengine.config import CacheConfig, EngineConfig
    from refengine.engine.engine import Engine

    def fingerprint(kv_cache_dtype: str) -> str:
        engine = Engine.from_config(EngineConfig(kv_cache_dtype=kv_cache_dtype, cache=CacheConfig(num_blocks=16)))
        return engine.core.model_fingerprint

    assert fingerprint("bfloat16") != fingerprint("float32") == fingerprint("auto")


def test_a_hostile_layer_count_is_refused_before_naming_every_layer(model_dir: Path) -> None:
    """Found by review: the check named every tensor of every declared layer first, so
    num_hidden_layers 10**9 exhausted the memory instead of being refused. Now the last layer
    is looked up first (10**5 here: without the fix it costs seconds and names layer 10)."""
    edit_config(model_dir, num_hidden_layers=10**5)
    with pytest.raises(UnsupportedModelError, match=r"lack model\.layers\.99999\.input_layernorm\.weight "
                                                    r"\(config\.json says num_hidden_layers=100000\)"):
        load_weights(model_dir)


def test_a_vision_models_fingerprint_counts_its_image_preprocessing(tmp_path: Path) -> None:
    """An image's rows, so its KV, depend on how the image processor resizes and normalizes it
    (preprocessor_config.json), which the fingerprint (prefix-cache keys, KV event hashes, a decode
    engine's check of a prefill's KV) did not count: two replicas differing only there keyed
    different KV alike (found by review). A copy with equal files keeps an equal fingerprint."""
    import shutil

    from refengine.config import CacheConfig, EngineConfig
    from refengine.engine.engine import Engine
    from tests.tiny_llava import build_tiny_llava

    def fingerprint(directory: Path) -> str:
        engine = Engine.from_config(EngineConfig(model=str(directory), max_model_len=256,
                                                 cache=CacheConfig(block_size=4, num_blocks=64)))
        return engine.core.model_fingerprint

    original = build_tiny_llava(tmp_path / "a").directory
    same, other = (Path(shutil.copytree(original, tmp_path / name)) for name in ("same", "other"))
    processor = json.loads((other / "preprocessor_config.json").read_text())
    processor["image_mean"] = [0.5, 0.5, 0.5]
    (other / "preprocessor_config.json").write_text(json.dumps(processor))
    assert fingerprint(original) == fingerprint(same) != fingerprint(other)
