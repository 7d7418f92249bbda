"""Incremental detokenization: a growing list of token ids in, stable text deltas out.

Decoding one token at a time and concatenating is wrong: a character may be split
over several tokens (byte-level BPE pieces, SentencePiece ``<0xE2>`` byte-fallback
tokens), and a decoder may strip the leading space of the first token it sees.
So, as vLLM does, we decode a short *window* of ids twice - with and without the
newest tokens - and emit the difference once it is stable:

    ids:   ... | prefix window | unread tokens
                 ^prefix_offset ^read_offset
    delta = decode(ids[prefix_offset:])[len(decode(ids[prefix_offset:read_offset])):]

A boundary (``read_offset``) is *stable* when text decoded before it can no longer
change whatever follows: the decoded text does not end in U+FFFD (an incomplete
UTF-8 character) and the last token is not a byte-fallback token (the ByteFallback
decoder turns a whole run of byte tokens into U+FFFD, one per byte, if any byte of
the run is invalid - so even a complete character may still change).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from refengine.engine.token_texts import REPLACEMENT_CHAR, decode, tokenizer_info

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CONTEXT_TOKENS = 5  # prompt tokens decoded as left context of the first output tokens (as vLLM)


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Invariants:
    - Once ``flush`` was called, the concatenation of all deltas is the text the
      output adds after the prompt: ``decode(ctx + out)[len(decode(ctx)):]`` where
      ``ctx`` is the prompt's last ``CONTEXT_TOKENS`` ids, or, when the prompt does not
      end at a stable boundary, the tokenizer's neutral context ("a"; empty without one).
      For byte-level BPE (SmolLM2, Llama 3) this equals ``decode(out)``; for SentencePiece
      it differs from ``decode(out)`` only by keeping the first output token's leading
      space, which is the point.
    - A delta from ``add_token`` never ends in U+FFFD and never changes later:
      text that may still change is held back until it is stable or ``flush``.
    - Cost per token: two decodes of a short window (ids since the last stable
      boundary but one; three when held tokens are released), never of the whole output.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._byte_values = tokenizer_info(tokenizer).byte_values
        context = list(prompt_token_ids[-CONTEXT_TOKENS:])
        context_text = decode(tokenizer, context)
        if context and (context[-1] in self._byte_values or context_text.endswith(REPLACEMENT_CHAR)):
            # unstable boundary: a neutral left context ("a") instead, so that a SentencePiece
            # first token keeps its leading space, as after a stable prompt
            info = tokenizer_info(tokenizer)
            context, context_text = list(info.context_ids), info.context_text
        self._ids = context  # ids[prefix_offset:], the window; older ids are dropped
        self._read_offset = len(context)  # relative to self._ids; everything before it was emitted
        self._prefix_text = context_text  # decode(self._ids[:self._read_offset])
        #: Of the last delta, the characters that the tokens before the last one made (their
        #: text was held back and came with it): where a byte-fallback run's own text ends.
        self.num_chars_before_last = 0
        #: Continuation bytes the held byte-fallback run still needs to end its UTF-8 character
        #: (0: the last byte token ended one, so the held text may now read differently).
        self._utf8_needed = 0
        #: The window of the last text that several tokens made together: (ids, read offset,
        #: prefix text), for ``token_ends``; None when the last text came from one token.
        self._run: tuple[list[int], int, str] | None = None
        self._num_added = 0  # tokens added: the output's number of the last one

    def add_token(self, token_id: int) -> str:
        """Append one output token; return the text that became stable (maybe "")."""
        self._ids.append(token_id)
        self._num_added += 1
        self.num_chars_before_last = 0
        self._run = None
        byte = self._byte_values.get(token_id)
        if byte is not None:
            self._utf8_needed = _utf8_needed(byte, self._utf8_needed)
            return ""  # a byte-fallback run may still turn into replacement characters
        self._utf8_needed = 0
        text = decode(self._tokenizer, self._ids)
        if (
            len(text) <= len(self._prefix_text)
            or text.endswith(REPLACEMENT_CHAR)
            or not text.startswith(self._prefix_text)
        ):
            # Not stable yet: hold back, the window grows. (A decoder that is not local at
            # any boundary would hold everything until flush; none of the Llama family's is.)
            return ""
        delta = text[len(self._prefix_text) :]
        if len(self._ids) - 1 > self._read_offset:  # earlier tokens' text comes with this one
            self.num_chars_before_last = self._split_before_last(text, len(delta))
            self._run = (self._ids.copy(), self._read_offset, self._prefix_text)
        # The unread tokens become the next prefix window; the new boundary is the end.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._prefix_text = decode(self._tokenizer, self._ids)
        return delta

    def _split_before_last(self, text: str, delta_chars: int) -> int:
        """How much of the delta the tokens before the last one made; all of it where the
        last token's text does not simply follow theirs."""
        before = decode(self._tokenizer, self._ids[:-1])
        if before.startswith(self._prefix_text) and text.startswith(before):
            return len(before) - len(self._prefix_text)
        return delta_chars

    @property
    def holds_text(self) -> bool:
        """Whether tokens added since the last returned delta have text not returned yet (the
        pieces of a character still being decoded): their text comes with a later token's."""
        return len(self._ids) > self._read_offset

    @property
    def ended_character(self) -> bool:
        """Whether the held text ends at a whole UTF-8 character (the last token was not a
        byte piece in the middle of one): only then can a held run newly complete a stop string."""
        return self._utf8_needed == 0

    def peek(self) -> str:
        """What ``flush`` would return now, without changing anything."""
        if len(self._ids) == self._read_offset:
            return ""
        return decode(self._tokenizer, self._ids)[len(self._prefix_text) :]

    def peek_final(self) -> str:
        """``peek`` less what a later token may still change: a trailing U+FFFD of a byte-level
        BPE piece (the next piece may complete its character; found by review: a stop string
        "\ufffd" matched every emoji split across tokens). After a byte-fallback piece that
        ended its character (``ended_character``) the held text is final as it reads."""
        held = self.peek()
        return held if self._ids and self._ids[-1] in self._byte_values else held.rstrip(REPLACEMENT_CHAR)

    def token_ends(self) -> tuple[int, ...] | None:
        """For the last text that several tokens made together (the held ones, then the one that
        released it or ``flush``), where each token's own text ends in it: the longest decode of
        the tokens up to it that the text starts with. A piece of a character ends where the
        token that completes it does. None when the last text came from one token. Costs one
        decode per token of the run: called only where an excluded stop string may cut it."""
        if self._run is None:
            return None
        ends = self._readable_ends(*self._run, len(self._run[0]))
        for i in range(len(ends) - 2, -1, -1):
            if ends[i] is None:
                ends[i] = ends[i + 1]
        return tuple(end for end in ends if end is not None)

    def chars_of_first(self, num_tokens: int, held: bool = False) -> int | None:
        """Of the last text returned (``held``: of ``peek``'s), the characters that the output's
        first ``num_tokens`` tokens completed; None when all of it is theirs. ``min_tokens``: no
        stop string may end there, also where a byte run releases their text later (found by
        review: stop "\n" as a first ``<0x0A>`` token ended an output with min_tokens 1)."""
        window = (self._ids, self._read_offset, self._prefix_text) if held else self._run
        size = len(window[0]) - window[1] if window is not None else 1
        inside = num_tokens - (self._num_added - size)  # of the window's tokens, those among the first
        if inside >= size:
            return None
        if inside <= 0 or window is None:
            return 0
        ends = self._readable_ends(*window, window[1] + inside, whole_characters=True)
        return max((end for end in ends if end is not None), default=0)

    def _readable_ends(self, ids: list[int], start: int, prefix: str, upto: int,
                       whole_characters: bool = False) -> list[int | None]:
        """For each token of ``ids[start:upto]``: where the text of the tokens up to it ends in the
        window's text (after ``prefix``), when that text reads as the start of the window's; None
        for a piece of a character. ``whole_characters``: a byte-level piece ending in part of a
        character ends after its whole ones (they are its own: found by review, min_tokens let a
        stop string its space made end the output, as if the next token had made it)."""
        whole = decode(self._tokenizer, ids)
        ends: list[int | None] = []
        for end in range(start + 1, upto + 1):
            partial = whole if end == len(ids) else decode(self._tokenizer, ids[:end])
            reads = end == len(ids) or (partial.startswith(prefix) and whole.startswith(partial))
            if not reads and whole_characters and ids[end - 1] not in self._byte_values:
                partial = partial.rstrip(REPLACEMENT_CHAR)
                reads = partial.startswith(prefix) and whole.startswith(partial)
            ends.append(len(partial) - len(prefix) if reads else None)
        return ends

    def flush(self) -> str:
        """At finish: release whatever was held back (U+FFFD where bytes never completed)."""
        text = decode(self._tokenizer, self._ids)
        delta = text[len(self._prefix_text) :]
        if len(self._ids) > self._read_offset:  # it releases text: its tokens are the last run
            self._run = (self._ids, self._read_offset, self._prefix_text) if len(self._ids) - self._read_offset > 1 \
                else None
        self._ids = []
        self._read_offset = 0
        self._prefix_text = ""
        return delta


class NoTextDetokenizer:
    """For an output that sends token ids only (``detokenize = false``) and has no stop
    strings: no text is needed at all, so none is computed."""

    holds_text = False
    ended_character = True
    num_chars_before_last = 0

    def add_token(self, token_id: int) -> str:
        return ""

    def peek(self) -> str:
        return ""

    def peek_final(self) -> str:
        return ""

    def token_ends(self) -> tuple[int, ...] | None:
        return None

    def chars_of_first(self, num_tokens: int, held: bool = False) -> int | None:
        return 0

    def flush(self) -> str:
        return ""


def _utf8_needed(byte: int, needed: int) -> int:
    """The continuation bytes still needed after ``byte``, ``needed`` before it (a stray or
    invalid byte ends the character: the decoder makes it U+FFFD)."""
    if 0x80 <= byte < 0xC0:
        return max(needed - 1, 0)
    if 0xC0 <= byte < 0xE0:
        return 1
    if 0xE0 <= byte < 0xF0:
        return 2
    if 0xF0 <= byte < 0xF8:
        return 3
    return 0
