"""GGUF conversion refuses what it cannot convert, naming the file and the field, and reads
nothing but the GGUF itself (not the files that happen to sit beside it)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gguf
import pytest

from refengine.model import UnsupportedModelError, load_model_config, load_tokenizer, resolve_model
from tests.unit.test_loader import CHAT_TEMPLATE, tiny_model, write_tiny_gguf


def test_files_beside_the_gguf_never_reach_the_conversion(tmp_path: Path) -> None:
    """A tokenizer_config.json/config.json with an auto_map (code in that folder) and another model's
    chat template and EOS beside the GGUF: no code runs, and the GGUF's own template and EOS win."""
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny_model(), gguf_path)
    marker = tmp_path / "ran"
    (tmp_path / "evil_tok.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\n"
        "from transformers import PreTrainedTokenizerFast\nclass Evil(PreTrainedTokenizerFast):\n    pass\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Evil", "auto_map": {"AutoTokenizer": [None, "evil_tok.Evil"]},
        "chat_template": "OTHER MODEL {{ messages[0]['content'] }}", "eos_token": "<|endoftext|>"}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama",
                                                      "auto_map": {"AutoConfig": "evil_tok.Cfg"}}))
    tokenizer = load_tokenizer(resolve_model(str(gguf_path), cache_dir=tmp_path / "cache").path)
    assert not marker.exists()
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)


def _without(_method: str) -> Any:
    return lambda self, *args, **kwargs: None


def _zero(method: str) -> Any:
    original = getattr(gguf.GGUFWriter, method)
    return lambda self, value: original(self, 0)


def _skip_tensor(name: str) -> Any:
    original = gguf.GGUFWriter.add_tensor
    return lambda self, tensor_name, *args, **kwargs: (
        None if tensor_name == name else original(self, tensor_name, *args, **kwargs))


@pytest.mark.parametrize(
    ("method", "patch", "message"),
    [
        ("add_embedding_length", _without, "metadata llama.embedding_length is None"),
        ("add_head_count", _without, "metadata llama.attention.head_count is None"),
        ("add_head_count", _zero, "metadata llama.attention.head_count is 0"),
        ("add_context_length", _without, "metadata llama.context_length is None"),
        ("add_tensor", lambda _: _skip_tensor("token_embd.weight"), "has no token_embd.weight tensor"),
    ],
    ids=["no-embedding-length", "no-head-count", "zero-heads", "no-context-length", "no-token-embd"],
)
def test_a_malformed_gguf_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str, patch: Any,
                                   message: str) -> None:
    """Missing or zero metadata, or no embeddings tensor: UnsupportedModelError naming the file and the
    field, before any arithmetic (was TypeError, ZeroDivisionError, KeyError)."""
    gguf_path = tmp_path / "bad.gguf"
    with monkeypatch.context() as patched:
        patched.setattr(gguf.GGUFWriter, method, patch(method))
        write_tiny_gguf(tiny_model(), gguf_path)
    with pytest.raises(UnsupportedModelError, match=message) as raised:
        resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    assert str(gguf_path) in str(raised.value)


def test_an_unreadable_gguf_is_named(tmp_path: Path) -> None:
    """A truncated GGUF: UnsupportedModelError naming the file, not the reader's bare ValueError."""
    gguf_path = tmp_path / "cut.gguf"
    write_tiny_gguf(tiny_model(), gguf_path)
    gguf_path.write_bytes(gguf_path.read_bytes()[: gguf_path.stat().st_size // 2])
    with pytest.raises(UnsupportedModelError, match=f"{gguf_path} is not a readable GGUF file"):
        resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")


def test_a_gguf_linked_to_a_blob_without_the_suffix_is_served(tmp_path: Path) -> None:
    """The Hugging Face hub cache layout: ``snapshots/<rev>/tiny.gguf`` links to ``blobs/<sha256>``.
    Found by review: the suffix was checked on the link's target, so the file was refused as
    'neither a Hugging Face model directory nor a .gguf file', naming the blob."""
    blob = tmp_path / "blobs" / "3f5a9c0d1e2b"
    blob.parent.mkdir()
    write_tiny_gguf(tiny_model(), blob)
    link = tmp_path / "snapshots" / "tiny.gguf"
    link.parent.mkdir()
    link.symlink_to(Path("..") / "blobs" / blob.name)
    resolved = resolve_model(str(link), cache_dir=tmp_path / "cache")
    assert resolved.name == "tiny"
    assert load_tokenizer(resolved.path).eos_token_id == 2
    # And the other way round, which the first fix refused (found by its review): a link without the
    # suffix (``current``) to a .gguf file, served under the file's name.
    model = tmp_path / "model.gguf"
    write_tiny_gguf(tiny_model(), model)
    current = tmp_path / "current"
    current.symlink_to(model)
    assert resolve_model(str(current), cache_dir=tmp_path / "cache").name == "model"


def test_a_gguf_naming_no_eos_is_served_without_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: the conversion's bos/eos check read the first of no EOS ids, an IndexError
    (a traceback from serve and generate). transformers loads such a GGUF with no EOS; so does refengine."""
    gguf_path = tmp_path / "no-eos.gguf"
    with monkeypatch.context() as patched:
        patched.setattr(gguf.GGUFWriter, "add_eos_token_id", _without("add_eos_token_id"))
        write_tiny_gguf(tiny_model(), gguf_path)
    resolved = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    assert load_model_config(resolved.path).eos_token_ids == ()
    assert load_tokenizer(resolved.path).eos_token_id is None
