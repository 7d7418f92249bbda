"""Tokens follow their text (G11, G14): the engine sends a token only once all of its text has
been emitted, and with ``include_stop_in_output = false`` drops the tokens whose text reaches
into a matched stop string. Fed one ``TokenStep`` (``stop_checker.process_token``) per token.
"""

from __future__ import annotations

from collections import deque

from refengine.types import FinishInfo, TokenInfo


class TokenHoldBack:
    """Tokens wait until all of their text has been emitted (G11, G14).

    Offsets count characters of the detokenized output. A token whose text is still
    held back (it may become part of a stop string) is held too. A token whose text is
    not decoded yet (``text_pending``: a piece of a multi-byte character) ends where its
    run's text ends, which comes with a later token's (``num_chars_before`` of that token's
    characters are the run's). When a stop string matched and is
    excluded, the tokens whose text reaches into it are dropped (so also the byte pieces
    of its characters); when it is included, or the output ends for another reason,
    every held token is released.
    """

    def __init__(self, include_stop_in_output: bool) -> None:
        self._include_stop = include_stop_in_output
        self._held: deque[tuple[TokenInfo, int]] = deque()  # (token, end offset of its text)
        self._undecoded: list[TokenInfo] = []  # after the held ones: their text comes later
        self._text_end = 0  # detokenized characters so far
        self._emitted_end = 0  # characters emitted so far

    def add(self, token: TokenInfo | None, num_chars: int, text_pending: bool, num_chars_before: int,
            token_ends: tuple[int, ...] | None = None) -> None:
        """One step's token, its text ``num_chars`` long; ``token`` None for a dropped stop token
        or EOS, whose step may still have released the undecoded tokens' text (a flush).
        ``token_ends``: where each of the undecoded tokens, then ``token``, ends in that text;
        without them the undecoded ones end at ``num_chars_before`` and ``token`` at the end."""
        start = self._text_end
        self._text_end += num_chars
        if text_pending:
            assert token is not None, "a dropped token ends the output: nothing is pending after it"
            self._undecoded.append(token)
            return
        if not self._undecoded:  # the common case, once per token: no run to place
            if token is not None:
                self._held.append((token, self._text_end))
            return
        run = [*self._undecoded, *([token] if token is not None else [])]
        ends = token_ends if token_ends is not None and len(token_ends) == len(run) else \
            (*[num_chars_before] * len(self._undecoded), *([num_chars] if token is not None else []))
        self._held.extend((t, start + end) for t, end in zip(run, ends, strict=True))
        self._undecoded.clear()

    def release(self, num_emitted_chars: int, finish: FinishInfo | None) -> tuple[TokenInfo, ...]:
        self._emitted_end += num_emitted_chars
        drop_rest = finish is not None and finish.stop_text is not None and not self._include_stop
        if finish is not None and not drop_rest:
            released = (*(token for token, _ in self._held), *self._undecoded)
            self._held.clear()
            self._undecoded.clear()
            return released
        released = []
        while self._held and self._held[0][1] <= self._emitted_end:
            released.append(self._held.popleft()[0])
        if finish is not None:
            self._held.clear()
            self._undecoded.clear()
        return tuple(released)
