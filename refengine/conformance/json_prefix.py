"""Is a text the beginning of a JSON document?

A grammar-constrained output cut off by ``max_tokens`` (``FINISH_REASON_LENGTH``) is not a
whole document, but every prefix of it must still be completable: a server that follows a
JSON grammar can never emit a character that no valid document continues with. This is
what the guided checks verify when a greedy model loops inside a JSON value (a number's
digits, a string) instead of closing it. Plain Python, no JSON-schema dependency.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")
_NUMBER_CHARS = frozenset("-+.eE0123456789")
_ESCAPES = frozenset('"\\/bfnrt')
_HEX = frozenset("0123456789abcdefABCDEF")
_LITERALS = ("true", "false", "null")
_WHITESPACE = " \t\n\r"


class _NotJson(ValueError):
    pass


def json_prefix_problem(text: str, top: str = "") -> str | None:
    """None when ``text`` is a prefix of some JSON document (whose top-level value starts
    with ``top``, e.g. ``"{"``, when given); else what is wrong, and where."""
    stripped = text.lstrip(_WHITESPACE)
    if top and stripped and not stripped.startswith(top):
        return f"the document starts with {stripped[:1]!r}, expected {top!r}"
    try:
        _Scanner(text).document()
    except _NotJson as exc:
        return str(exc)
    return None


class _Scanner:
    """A recursive-descent JSON reader that treats the end of the text as "fine so far"."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    class End(Exception):  # noqa: N818 - control flow: the text ended inside a valid prefix
        pass

    def document(self) -> None:
        try:
            self.value()
            self.skip_ws()
            if self.pos < len(self.text):
                self.bad("text after the end of the document")
        except _Scanner.End:
            return

    def bad(self, what: str) -> None:
        raise _NotJson(f"{what} at offset {self.pos}: {self.text[max(0, self.pos - 12): self.pos + 12]!r}")

    def peek(self) -> str:
        self.skip_ws()
        if self.pos >= len(self.text):
            raise _Scanner.End
        return self.text[self.pos]

    def skip_ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in _WHITESPACE:
            self.pos += 1

    def value(self) -> None:
        c = self.peek()
        if c == "{":
            self.container("}", member=True)
        elif c == "[":
            self.container("]", member=False)
        elif c == '"':
            self.string()
        elif c in _NUMBER_CHARS:
            self.number()
        elif c.isalpha():
            self.literal()
        else:
            self.bad(f"unexpected {c!r}")

    def container(self, close: str, member: bool) -> None:
        self.pos += 1
        if self.peek() == close:
            self.pos += 1
            return
        while True:
            if member:
                if self.peek() != '"':
                    self.bad("expected a key")
                self.string()
                if self.peek() != ":":
                    self.bad("expected ':'")
                self.pos += 1
            self.value()
            c = self.peek()
            self.pos += 1
            if c == close:
                return
            if c != ",":
                self.pos -= 1
                self.bad(f"expected ',' or {close!r}")

    def string(self) -> None:
        self.pos += 1  # the opening quote
        while self.pos < len(self.text):
            c = self.text[self.pos]
            self.pos += 1
            if c == '"':
                return
            if ord(c) < 0x20:
                self.bad("a control character inside a string")
            if c == "\\":
                self.escape()
        raise _Scanner.End

    def escape(self) -> None:
        if self.pos >= len(self.text):
            raise _Scanner.End
        c = self.text[self.pos]
        self.pos += 1
        if c == "u":
            digits = self.text[self.pos: self.pos + 4]
            if any(d not in _HEX for d in digits):
                self.bad("a bad \\u escape")
            self.pos += len(digits)
            if len(digits) < 4:
                raise _Scanner.End
        elif c not in _ESCAPES:
            self.bad(f"a bad escape \\{c}")

    def number(self) -> None:
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] in _NUMBER_CHARS:
            self.pos += 1
        token = self.text[start: self.pos]
        at_end = self.pos == len(self.text)
        # Cut off mid-number ("1.", "-", "1e+"), a digit could still complete it.
        if _NUMBER.fullmatch(token) or (at_end and _NUMBER.fullmatch(token + "0")):
            if at_end:
                raise _Scanner.End
            return
        self.pos = start
        self.bad(f"not a number {token!r}")

    def literal(self) -> None:
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos].isalpha():
            self.pos += 1
        word = self.text[start: self.pos]
        if self.pos == len(self.text) and any(lit.startswith(word) for lit in _LITERALS):
            raise _Scanner.End
        if word not in _LITERALS:
            self.pos = start
            self.bad(f"not a literal {word!r}")
