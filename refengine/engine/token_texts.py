"""What tokens read as: the engine's one ``decode`` of ids, and each token's own text (for
``TokenInfo.text`` and candidates), cached per tokenizer with the facts the detokenizer needs
(its byte-fallback tokens, a byte-level vocabulary's bytes, a neutral left context)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenizers import decoders

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"


def decode(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str:
    """The engine's one definition of "the text of these ids": special tokens kept,
    no tokenization-space clean-up (it is not local, so it cannot be streamed)."""
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


@dataclass
class TokenizerInfo:
    """Facts about one tokenizer, computed once and shared by all requests."""

    byte_values: dict[int, int]  # id of each ``<0xNN>`` byte-fallback token -> its byte NN
    context_ids: tuple[int, ...]  # a neutral left context for ``token_text`` ("a"), or ()
    context_text: str
    #: For a byte-level BPE tokenizer (GPT-2 style: SmolLM2, Llama 3), the UTF-8 bytes of each
    #: vocabulary token, decoded as one stream; None for any other kind. Added tokens (specials)
    #: are absent: ``decode`` writes them as they are and they end the byte stream before them.
    token_bytes: dict[int, bytes] | None = None
    token_texts: dict[int, str] = field(default_factory=dict)


_INFO: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, TokenizerInfo] = weakref.WeakKeyDictionary()


def tokenizer_info(tokenizer: PreTrainedTokenizerBase) -> TokenizerInfo:
    info = _INFO.get(tokenizer)
    if info is None:
        byte_values = {}
        for byte in range(256):
            name = f"<0x{byte:02X}>"
            token_id = tokenizer.convert_tokens_to_ids(name)
            if isinstance(token_id, int) and tokenizer.convert_ids_to_tokens(token_id) == name:
                byte_values[token_id] = byte
        context_ids = tuple(tokenizer.encode("a", add_special_tokens=False))
        context_text = decode(tokenizer, context_ids)
        if context_text != "a":  # an odd tokenizer: do without context rather than guess
            context_ids, context_text = (), ""
        info = TokenizerInfo(byte_values, context_ids, context_text, _token_bytes(tokenizer))
        _INFO[tokenizer] = info
    return info


def _token_bytes(tokenizer: PreTrainedTokenizerBase) -> dict[int, bytes] | None:
    """Each vocabulary token's bytes, where the decoder is ByteLevel: it maps every character of a
    token back to one byte (GPT-2's byte-to-unicode table; a character outside it stands for its
    own UTF-8 bytes) and decodes the bytes of consecutive tokens together, lossily."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    byte_of = {char: byte for byte, char in _bytes_to_unicode().items()}
    added = set(tokenizer.get_added_vocab().values())
    ids = [token_id for token_id in range(len(tokenizer)) if token_id not in added]
    names = tokenizer.convert_ids_to_tokens(ids)
    return {
        token_id: b"".join(bytes((byte_of[c],)) if c in byte_of else c.encode() for c in name)
        for token_id, name in zip(ids, names, strict=True) if name is not None
    }


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: printable bytes stand for themselves, the others for characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    return {**{byte: chr(byte) for byte in printable}, **{byte: chr(256 + i) for i, byte in enumerate(others)}}


def token_text(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    """One token's own text, for ``TokenInfo.text`` and candidates (cached per tokenizer).

    Decoded after a neutral left context ("a") so that a SentencePiece ``▁word``
    keeps its leading space (decoding it alone would strip it). A token that is only
    part of a UTF-8 character (a byte piece) reads as U+FFFD, as ``decode([id])`` does.
    """
    return token_texts(tokenizer, (token_id,))[0]


def token_texts(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int]) -> list[str]:
    """``token_text`` of each id: one cache lookup per id (``all`` candidates ask for the
    whole vocabulary with every token)."""
    info = tokenizer_info(tokenizer)
    cached = info.token_texts
    texts = [cached.get(token_id) for token_id in token_ids]
    for i, text in enumerate(texts):
        if text is None:
            texts[i] = _uncached_text(tokenizer, info, token_ids[i])
    return texts


def _uncached_text(tokenizer: PreTrainedTokenizerBase, info: TokenizerInfo, token_id: int) -> str:
    with_context = decode(tokenizer, [*info.context_ids, token_id])
    if info.context_ids and with_context.startswith(info.context_text):
        text = with_context[len(info.context_text) :]
    else:
        text = decode(tokenizer, [token_id])
    info.token_texts[token_id] = text
    return text
