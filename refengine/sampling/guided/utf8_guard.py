"""Keeping xgrammar's guides to well-formed UTF-8: no UTF-16 surrogate (U+D800-U+DFFF).

xgrammar 0.2.9 reads the bytes ``ED A0..BF xx`` as a code point like any other, so a JSON string,
a negated class or a regex ``.`` let a surrogate through (about 1 % of random walks through
``{"type": "string"}`` on a byte-fallback vocabulary), and the output was no longer valid UTF-8:
decoded, its bytes became U+FFFD, a closing quote's with them, and the JSON was gone. It refuses
the other malformed sequences (overlong forms, past U+10FFFF, stray continuation bytes) itself.
llguidance never allows a surrogate.

A surrogate's encoding starts with the byte ED followed by A0-BF. A token that ends on the lead
byte ED leaves its second byte to the next token, so after one the guard clears every token that
starts with A0-BF; a token holding ED A0-BF itself is never allowed (no trained vocabulary has one).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from refengine.sampling.guided.bitmask import BITS

_LEAD = 0xED
_SURROGATE_SECOND = range(0xA0, 0xC0)


def _words(token_ids: Sequence[int], num_words: int) -> torch.Tensor:
    """A bitmask row with the bits of ``token_ids`` set, as int32 words."""
    words = [0] * num_words
    for token_id in token_ids:
        words[token_id // BITS] |= 1 << (token_id % BITS)
    return torch.tensor([w - (1 << BITS) if w >= 1 << (BITS - 1) else w for w in words], dtype=torch.int32)


class SurrogateGuard:
    """What a matcher clears from its masks, built once per vocabulary (``decoded_vocab``: each
    token's bytes, as xgrammar's ``TokenizerInfo`` gives them)."""

    def __init__(self, decoded_vocab: Sequence[bytes], vocab_size: int) -> None:
        num_words = (vocab_size + BITS - 1) // BITS
        ids = range(min(len(decoded_vocab), vocab_size))
        self.ends_on_lead = frozenset(t for t in ids if decoded_vocab[t].endswith(b"\xed"))
        self._after_lead = ~_words([t for t in ids if decoded_vocab[t][:1] and decoded_vocab[t][0]
                                    in _SURROGATE_SECOND], num_words)
        never = [t for t in ids if any(a == _LEAD and b in _SURROGATE_SECOND
                                       for a, b in zip(decoded_vocab[t], decoded_vocab[t][1:], strict=False))]
        self._never = ~_words(never, num_words) if never else None

    def restrict(self, row: torch.Tensor, after_lead: bool) -> None:
        """Clear, in the bitmask ``row``, the tokens that would make a surrogate next."""
        if after_lead:
            row &= self._after_lead
        if self._never is not None:
            row &= self._never
