"""What tokens read as: the engine's one ``decode`` of ids, and each token's own text (for
``TokenInfo.text`` and candidates), cached per tokenizer with the facts the detokenizer needs
(its byte-fallback tokens, a neutral left context)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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
        info = TokenizerInfo(byte_values, context_ids, context_text)
        _INFO[tokenizer] = info
    return info


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
