"""Held bytes, judged incrementally: the detokenizer holds text back while it may still change,
and this tells it when it can no longer change without decoding the held tokens again for
every token (which made a long held run cost O(n²) on the engine's step thread).

- ``ByteStream``: the bytes of a byte-level BPE output (SmolLM2, Llama 3). ``decode`` reads them
  as one lossy UTF-8 stream, so its text so far is final once the bytes end at a complete
  character or at an invalid byte that no later byte can complete. A literal U+FFFD (EF BF BD)
  is complete: judging by the decoded text's last character could not tell it from a piece.
- ``ByteRun``: a run of SentencePiece byte-fallback tokens (``<0xNN>``). The ByteFallback decoder
  reads a run as its UTF-8 text, or as one U+FFFD per byte when any byte of it is invalid or it
  ends mid-character, so the whole run stays held; this keeps what it reads as so far.
- ``HeldText``: the text either keeps, as the pieces it grew by: the stop-string check reads on
  from the pieces it read, and a bounded check reads only the first pieces, instead of the whole
  held text being joined (and compared) again per token, O(n²) over a run that never ends.

Python's UTF-8 codec is the judge: like ``decode`` (Rust's ``from_utf8_lossy``) it replaces each
maximal invalid subpart by one U+FFFD. Its incremental decoder waits on one kind of invalid
prefix, ED A0-BF (a surrogate's), that ``decode`` already replaces: ``_read`` does not wait on it
(checked for every 1-3 byte sequence and split point: what stays buffered is exactly the valid
prefix of a character that ends the bytes, and the text read plus one U+FFFD for it is their
lossy decoding).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from refengine.engine.token_texts import REPLACEMENT_CHAR


class HeldText(list[str]):
    """Held text that only grows while it is this object: the pieces it grew by (one or two a
    token), only ever appended, so whoever read some of them has read a prefix of it for good.
    Text that changes other than by growing (a byte run turning invalid, text released) is a new
    object. (A list: one is made per released token, on the step thread.)"""

    __slots__ = ()

    def __str__(self) -> str:
        return "".join(self)

    def head(self, limit: int) -> str:
        """At least the first ``limit`` characters (all, when it has fewer), joining only the pieces
        they are in."""
        size = 0
        for count, piece in enumerate(self, start=1):
            size += len(piece)
            if size >= limit:
                return "".join(self[:count])
        return str(self)


class ByteStream:
    """The bytes of a byte-level BPE output: where they end a character, and the whole
    characters of the held tokens (those since ``release``), for an early stop-string check."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        #: The held tokens' whole characters: final, so they only grow until ``release``.
        self.held = HeldText()

    def add(self, data: bytes | None, text: str) -> bool:
        """Append one token's bytes (None: an added token, ``text``, which ``decode`` writes as
        it is and which ends the bytes before it); return whether the bytes now end a character."""
        if data is None:
            self.held.extend((self._decoder.decode(b"", final=True), text))
            return True
        self.held.append(_read(self._decoder, data))
        return not self._decoder.getstate()[0]  # no bytes buffered: nothing can still change

    def held_text(self, limit: int | None = None) -> str:
        """The held tokens' text with the bytes of a character still incomplete as the one U+FFFD
        that ``decode`` makes of them now; ``limit``: at least its first ``limit`` characters."""
        held = str(self.held) if limit is None else self.held.head(limit)
        if limit is not None and len(held) >= limit:
            return held
        return held + (REPLACEMENT_CHAR if self._decoder.getstate()[0] else "")

    def release(self) -> None:
        """The held tokens' text was returned: what follows is held anew (a new object: a reader
        of the old one must not read on in it)."""
        self.held = HeldText()


class ByteRun:
    """One run of byte-fallback tokens, as the ByteFallback decoder reads it so far."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("strict")
        self.num_bytes = 0
        self._valid = True  # no invalid byte so far (the run may still end mid-character)
        #: Its characters so far while valid (less one still incomplete), then one U+FFFD per byte.
        self._text = HeldText()

    def add(self, byte: int) -> None:
        self.num_bytes += 1
        if not self._valid:
            self._text.append(REPLACEMENT_CHAR)
            return
        try:
            self._text.append(_read(self._decoder, bytes((byte,))))
        except UnicodeDecodeError:  # never valid again: every byte reads U+FFFD
            self._valid, self._text = False, HeldText([REPLACEMENT_CHAR] * self.num_bytes)

    @property
    def ended_character(self) -> bool:
        """Whether the last byte ended a character (after an invalid byte, every byte does)."""
        return not self._valid or not self._decoder.getstate()[0]

    def held(self) -> HeldText:
        """What the run reads as if it ended here (mid-character: one U+FFFD per byte, a new object)."""
        return self._text if self.ended_character else HeldText([REPLACEMENT_CHAR * self.num_bytes])

    def text(self, limit: int | None = None) -> str:
        """``str(held())``; ``limit``: at least its first ``limit`` characters."""
        if not self.ended_character:
            return REPLACEMENT_CHAR * (self.num_bytes if limit is None else min(limit, self.num_bytes))
        return str(self._text) if limit is None else self._text.head(limit)


def run_ends(data: bytes, tail: str, per_byte: bool = False) -> list[int | None]:
    """For each byte of a byte-fallback run whose window reads ``tail`` (the run's text, then
    that of a token ending the run, if any), where the text of the run up to it ends in
    ``tail``, when that text is how ``tail`` starts; None otherwise. The run up to a byte reads
    as its characters when they are complete and valid, else as one U+FFFD per byte. Linear:
    the characters only grow, and ``tail`` starts with U+FFFD * k for every k up to its count.
    ``per_byte``: a run whose whole characters no longer read (a later byte made it invalid: one
    U+FFFD per byte) ends after its k-th U+FFFD at its k-th byte, as an incomplete one does (the
    characters of the first ``min_tokens`` tokens: found by review, a valid character's bytes
    were given none of them, so a stop string ending in its U+FFFD was not protected)."""
    leading = len(tail) - len(tail.lstrip(REPLACEMENT_CHAR))
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    valid, chars, agrees = True, 0, True  # valid so far: its characters; tail starts with them
    ends: list[int | None] = []
    for k, byte in enumerate(data, start=1):
        if valid:
            try:
                new = _read(decoder, bytes((byte,)))
            except UnicodeDecodeError:
                valid = False
            else:
                agrees = agrees and tail.startswith(new, chars)
                chars += len(new)
        if valid and not decoder.getstate()[0]:
            ends.append(chars if agrees else k if per_byte and k <= leading else None)
        else:
            ends.append(k if k <= leading else None)
    return ends


def stream_ends(chunks: Sequence[bytes | str], tail: str, whole_characters: bool, after_fffd: bool) -> list[int | None]:
    """``run_ends`` for byte-level BPE tokens (``chunks``: each one's bytes, or an added token's
    text): the tokens up to one read as the characters their bytes complete, then one U+FFFD for
    a character still incomplete. ``whole_characters``: where that does not read, the text less
    its trailing U+FFFDs may (as ``str.rstrip``; none may be left of it when the window's prefix,
    ``after_fffd``, ends in one). Linear: the characters only grow."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    chars = common = trailing = 0  # characters read, how many of them tail starts with, U+FFFDs ending them
    ends: list[int | None] = []
    for chunk in chunks:
        new = decoder.decode(b"", final=True) + chunk if isinstance(chunk, str) else _read(decoder, chunk)
        if common == chars:
            ahead = tail[chars : chars + len(new)]  # not tail[chars:], a copy of the rest of a long tail
            common += next((i for i, (a, b) in enumerate(zip(new, ahead, strict=False)) if a != b), len(ahead))
        chars += len(new)
        kept = len(new.rstrip(REPLACEMENT_CHAR))
        trailing = trailing + len(new) if kept == 0 else len(new) - kept
        pending = bool(decoder.getstate()[0])
        if common == chars and (not pending or tail.startswith(REPLACEMENT_CHAR, chars)):
            ends.append(chars + pending)
        elif whole_characters and chars - trailing <= common and (chars > trailing or not after_fffd):
            ends.append(chars - trailing)
        else:
            ends.append(None)
    return ends


def _read(decoder: codecs.IncrementalDecoder, data: bytes) -> str:
    """``decoder.decode(data)``, but not waiting on ED A0-BF (strict: raising for it)."""
    text = decoder.decode(data)
    pending = decoder.getstate()[0]
    if pending[:1] == b"\xed" and pending[1:2] >= b"\xa0":
        text += decoder.decode(b"", final=True)
    return text
