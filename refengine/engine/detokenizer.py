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
change whatever follows: the last token is not a byte-fallback token (the ByteFallback
decoder turns a whole run of byte tokens into U+FFFD, one per byte, if any byte of
the run is invalid - so even a complete character may still change), and the text ends
at a whole character. For byte-level BPE that is judged from the tokens' bytes
(``held_bytes.ByteStream``: a literal U+FFFD is whole, a piece of a character is not),
before any decoding; for other tokenizers from the decoded text not ending in U+FFFD.
Held tokens are not decoded again per token: a byte-level piece is at most 3 bytes of a
character, and a held byte-fallback run's text is kept as it grows, in pieces (``HeldText``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from refengine.engine.held_bytes import ByteRun, ByteStream, HeldText, run_ends, stream_ends
from refengine.engine.token_texts import REPLACEMENT_CHAR, decode, token_text, tokenizer_info

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
    - A delta from ``add_token`` never changes later: text that may still change is held
      back until it is stable or ``flush``. It ends in U+FFFD only where no later token can
      change that (byte-level BPE: a literal U+FFFD, or a byte no later byte completes).
    - Cost per token: two decodes of a short window (ids since the last stable
      boundary but one; three when held tokens are released), never of the whole output.
      A byte-level piece or byte-fallback token costs none while it is held: the run is
      decoded once when released, and ``peek_final`` is the text kept as it grew, in pieces.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        info = tokenizer_info(tokenizer)
        self._byte_values = info.byte_values
        self._token_bytes = info.token_bytes  # None: not byte-level BPE
        self._stream = ByteStream()
        context = list(prompt_token_ids[-CONTEXT_TOKENS:])
        context_text = decode(tokenizer, context)
        if context and not self._ends_whole(context, context_text):
            # unstable boundary: a neutral left context ("a") instead, so that a SentencePiece
            # first token keeps its leading space, as after a stable prompt
            context, context_text = list(info.context_ids), info.context_text
            self._stream = ByteStream()
        self._stream.release()  # the context is the prefix: nothing of it is held
        self._ids = context  # ids[prefix_offset:], the window; older ids are dropped
        self._read_offset = len(context)  # relative to self._ids; everything before it was emitted
        self._prefix_text = context_text  # decode(self._ids[:self._read_offset])
        #: Of the last delta, the characters that the tokens before the last one made (their
        #: text was held back and came with it): where a byte-fallback run's own text ends.
        self.num_chars_before_last = 0
        #: Whether the last token ended a character (a byte-fallback piece in the middle of one
        #: did not): only then may the held text read differently.
        self._ended = True
        #: The byte-fallback run the last tokens make, as it reads so far; None after another token.
        self._byte_run: ByteRun | None = None
        #: The window of the last text that several tokens made together: (ids, read offset,
        #: prefix text), for ``token_ends``; None when the last text came from one token.
        self._run: tuple[list[int], int, str] | None = None
        self._num_added = 0  # tokens added: the output's number of the last one
        #: ``_ends_from_bytes`` of the held window: (its kept text, upto, the ends), once final
        self._held_ends: tuple[HeldText | None, int, tuple[int | None, ...]] = (None, 0, ())

    def add_token(self, token_id: int) -> str:
        """Append one output token; return the text that became stable (maybe "")."""
        self._ids.append(token_id)
        self._num_added += 1
        self.num_chars_before_last = 0
        self._run = None
        byte = self._byte_values.get(token_id)
        if byte is not None:
            self._byte_run = self._byte_run or ByteRun()
            self._byte_run.add(byte)
            self._ended = self._byte_run.ended_character
            return ""  # a byte-fallback run may still turn into replacement characters
        self._byte_run = None
        self._ended = True
        if self._token_bytes is not None and not self._add_bytes(token_id):
            return ""  # a byte-level piece of a character: the next bytes may complete it
        text = decode(self._tokenizer, self._ids)
        if (
            len(text) <= len(self._prefix_text)
            or (self._token_bytes is None and text.endswith(REPLACEMENT_CHAR))
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
        self._stream.release()
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._prefix_text = decode(self._tokenizer, self._ids)
        return delta

    def _ends_whole(self, ids: list[int], text: str) -> bool:
        """Whether ``ids`` (the prompt's context, reading ``text``) end at a whole character."""
        if self._token_bytes is None:
            return ids[-1] not in self._byte_values and not text.endswith(REPLACEMENT_CHAR)
        return [self._add_bytes(token_id) for token_id in ids][-1]

    def _add_bytes(self, token_id: int) -> bool:
        """Byte-level BPE: append the token's bytes; whether they end at a whole character."""
        assert self._token_bytes is not None
        data = self._token_bytes.get(token_id)
        return self._stream.add(data, token_text(self._tokenizer, token_id) if data is None else "")

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
        byte-fallback piece in the middle of one): only then can a held run newly complete a stop
        string. (``peek_final`` leaves a byte-level piece's incomplete character out.)"""
        return self._ended

    def peek(self, limit: int | None = None) -> str:
        """What ``flush`` would return now, without changing anything; ``limit``: at least its first
        ``limit`` characters (where the held text is kept, only those are joined)."""
        if len(self._ids) == self._read_offset:
            return ""
        if self._token_bytes is not None:  # the held tokens' text, as their bytes read
            return self._stream.held_text(limit)
        run = self._lone_run()
        return decode(self._tokenizer, self._ids)[len(self._prefix_text) :] if run is None else run.text(limit)

    def _kept(self) -> HeldText | None:
        """``peek_final`` where it is kept as it grows: byte-level BPE, a lone byte-fallback run (its
        last token is a byte: final as it reads)."""
        if self._token_bytes is not None:
            return self._stream.held
        run = self._lone_run()
        return run.held() if run is not None else None

    def _lone_run(self) -> ByteRun | None:
        """The byte-fallback run, when it is all that is held, after a prefix: it reads by itself."""
        run = self._byte_run
        return run if run and run.num_bytes == len(self._ids) - self._read_offset and self._prefix_text else None

    def peek_final(self) -> HeldText:
        """``peek`` less what a later token may still change: a trailing U+FFFD of a byte-level
        BPE piece (the next piece may complete its character; found by review: a stop string
        "\ufffd" matched every emoji split across tokens). Byte-level BPE: the held characters
        as its bytes read, kept as they came. After a byte-fallback piece that ended its
        character (``ended_character``) the held text is final as it reads. While it only grows, the
        same object (a stop-string check reads on in it)."""
        kept = self._kept()
        if kept is not None:
            return kept
        held = self.peek()
        return HeldText([held if self._ids and self._ids[-1] in self._byte_values else held.rstrip(REPLACEMENT_CHAR)])

    def token_ends(self) -> tuple[int, ...] | None:
        """For the last text that several tokens made together (the held ones, then the one that
        released it or ``flush``), where each token's own text ends in it: the longest decode of
        the tokens up to it that the text starts with. A piece of a character ends where the
        token that completes it does. None when the last text came from one token. Costs one
        decode and a pass over the run's bytes (byte-level BPE, a byte-fallback run), else one
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
        ends = self._readable_ends(*window, window[1] + inside, whole_characters=True, held=held)
        return max((end for end in ends if end is not None), default=0)

    def _readable_ends(self, ids: list[int], start: int, prefix: str, upto: int,
                       whole_characters: bool = False, held: bool = False) -> list[int | None]:
        """For each token of ``ids[start:upto]``: where the text of the tokens up to it ends in the
        window's text (after ``prefix``), when that text reads as the start of the window's; None
        for a piece of a character. ``whole_characters``: a byte-level piece ending in part of a
        character ends after its whole ones (they are its own: found by review, min_tokens let a
        stop string its space made end the output, as if the next token had made it). ``held``:
        the window is the held one, whose text is ``peek``'s (a byte run's kept text)."""
        whole = None if held else decode(self._tokenizer, ids)
        ends = self._ends_from_bytes(ids, start, prefix, upto, whole, whole_characters)
        if ends is not None:
            return ends
        whole = self._prefix_text + self.peek() if whole is None else whole
        ends = []
        for end in range(start + 1, upto + 1):
            partial = whole if end == len(ids) else decode(self._tokenizer, ids[:end])
            reads = end == len(ids) or (partial.startswith(prefix) and whole.startswith(partial))
            if not reads and whole_characters and ids[end - 1] not in self._byte_values:
                partial = partial.rstrip(REPLACEMENT_CHAR)
                reads = partial.startswith(prefix) and whole.startswith(partial)
            ends.append(len(partial) - len(prefix) if reads else None)
        return ends

    def _ends_from_bytes(self, ids: list[int], start: int, prefix: str, upto: int, whole: str | None,
                         whole_characters: bool) -> list[int | None] | None:
        """``_readable_ends`` in one pass over the tokens' bytes, without a decode per token, where
        they tell it: byte-level BPE, or a byte-fallback run after a prefix of its own text. The
        window's last token ends with it (it may be the one ending a run). ``whole``: the window's
        text; None for the held one's, read only as far as the tokens up to ``upto`` reach (not a
        long held run's per token): a byte reads as one character at most, an added token as its
        text after a U+FFFD. Once the kept held text has those (it only grows), they and the ends
        are final: kept too, not worked out again per token."""
        kept = self._kept() if whole is None and upto < len(ids) else None
        if kept is not None and self._held_ends[0] is kept and self._held_ends[1] == upto:
            return list(self._held_ends[2])
        inner = ids[start : min(upto, len(ids) - 1)]
        if self._token_bytes is not None:
            chunks = [token_text(self._tokenizer, t) if (d := self._token_bytes.get(t)) is None else d for t in inner]
            reach = sum(len(chunk) + 1 for chunk in chunks) + 1
        elif prefix and start and ids[start - 1] not in self._byte_values and set(inner) <= self._byte_values.keys():
            reach = len(inner) + 1
        else:
            return None
        if whole is not None and not whole.startswith(prefix):
            return None
        head = kept.head(reach) if kept is not None else ""  # final, when this long
        if whole is not None:
            tail = whole[len(prefix) :]
        else:
            tail = head if len(head) >= reach else self.peek(None if upto == len(ids) else reach)
        if self._token_bytes is not None:
            ends = stream_ends(chunks, tail, whole_characters, prefix.endswith(REPLACEMENT_CHAR))
        else:
            ends = run_ends(bytes(self._byte_values[t] for t in inner), tail, whole_characters)
        if len(head) >= reach:
            self._held_ends = (kept, upto, tuple(ends))
        return ends + [len(tail)] * (upto == len(ids))

    def flush(self) -> str:
        """At finish: release whatever was held back (U+FFFD where bytes never completed)."""
        text = decode(self._tokenizer, self._ids)
        delta = text[len(self._prefix_text) :]
        if len(self._ids) > self._read_offset:  # it releases text: its tokens are the last run
            self._run = (self._ids, self._read_offset, self._prefix_text) if len(self._ids) - self._read_offset > 1 \
                else None
        self._ids, self._read_offset, self._prefix_text = [], 0, ""
        self._stream, self._byte_run, self._ended = ByteStream(), None, True  # its bytes were read too
        return delta

