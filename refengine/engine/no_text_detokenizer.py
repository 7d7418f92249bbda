"""The detokenizer of an output that needs no text (``IncrementalDetokenizer``'s interface)."""

from __future__ import annotations

from refengine.engine.held_bytes import HeldText


class NoTextDetokenizer:
    """For an output that sends token ids only (``detokenize = false``) and has no stop
    strings: no text is needed at all, so none is computed."""

    holds_text = False
    ended_character = True
    num_chars_before_last = 0

    def add_token(self, token_id: int) -> str:
        return ""

    def peek(self, limit: int | None = None) -> str:
        return ""

    def peek_final(self) -> HeldText:
        return HeldText()

    def token_ends(self) -> tuple[int, ...] | None:
        return None

    def chars_of_first(self, num_tokens: int, held: bool = False) -> int | None:
        return 0

    def flush(self) -> str:
        return ""

