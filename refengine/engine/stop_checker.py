"""When one output stops, and what text and tokens it may still emit (RULES G13-G15).

Per sampled token the engine calls ``process_token`` (below), which does, in order:

1. ``StopChecker.check_token``: stop token ids and EOS (only once more than
   ``min_tokens`` tokens exist, the token itself included; EOS never with
   ``ignore_eos``), then ``max_tokens`` -> LENGTH. A token that is both a stop
   token id and EOS reports ``stop_token_id`` (the request named it).
2. The matched stop token / EOS with ``include_stop_in_output = false`` is kept out
   of both the tokens and the text: it is never fed to the detokenizer. With
   ``true`` it is an ordinary last token: in the tokens, its text (e.g.
   ``<|im_end|>``) in the text.
3. The token's text delta goes through ``StopChecker.feed_text``: text that could
   still be the start of a stop string is held back, across deltas; a match ends
   the output. A stop string found in this step's text wins over a stop token /
   LENGTH decided by the same token, since it ends at or before that token. Like stop
   tokens, a stop string completed by one of the first ``min_tokens`` tokens does not
   stop the output, also when a byte run releases their text later (vLLM's and SGLang's
   choice; G15 names only EOS and stop tokens).
4. When the output ends for another reason, held-back text is released.

Which stop string matches: the first one to be *completed* reading the text left
to right (the output stops there: nothing after it is generated or emitted); when
several complete at the same character, the longest. Tokens follow their text:
the engine holds a token back while any of its text is held back, and with
``include_stop_in_output = false`` drops the tokens whose text reaches into a
matched stop string (``TokenHoldBack``, ``token_hold_back.py``).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from refengine.types import FinishInfo, FinishReason, StoppingParams

if TYPE_CHECKING:
    from refengine.engine.detokenizer import IncrementalDetokenizer
    from refengine.engine.held_bytes import HeldText
    from refengine.engine.no_text_detokenizer import NoTextDetokenizer


class _StopAutomaton:
    """Aho-Corasick automaton over the stop strings (a trie plus failure links).

    Invariant: after reading any text, the state spells the longest suffix of that
    text that is a prefix of some stop string (``depth`` = its length), and
    ``match[state]`` is the longest stop string that is a suffix of it. Reading one
    character costs amortized O(1), whatever the number of stop strings.
    """

    def __init__(self, stop_strings: tuple[str, ...]) -> None:
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        self.match: list[str | None] = [None]
        for stop in stop_strings:
            state = 0
            for ch in stop:
                nxt = self.goto[state].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto.append({})
                    self.depth.append(self.depth[state] + 1)
                    self.match.append(None)
                    self.goto[state][ch] = nxt
                state = nxt
            self.match[state] = stop
        self.fail = [0] * len(self.goto)
        queue = deque(self.goto[0].values())
        while queue:  # breadth first: a failure target is always shallower, so already done
            state = queue.popleft()
            for ch, nxt in self.goto[state].items():
                queue.append(nxt)
                target = self.fail[state]
                while target and ch not in self.goto[target]:
                    target = self.fail[target]
                self.fail[nxt] = self.goto[target].get(ch, 0)
                if self.match[nxt] is None:
                    self.match[nxt] = self.match[self.fail[nxt]]

    def step(self, state: int, ch: str) -> int:
        goto, fail = self.goto, self.fail
        while True:
            nxt = goto[state].get(ch)
            if nxt is not None:
                return nxt
            if state == 0:
                return 0
            state = fail[state]


@functools.lru_cache(maxsize=64)
def _automaton(stop_strings: tuple[str, ...]) -> _StopAutomaton:
    """Built once per distinct stop list (immutable, shared by requests)."""
    return _StopAutomaton(stop_strings)


class StopChecker:
    """Decides when one output stops and what text/tokens may be emitted (RULES G13-G15).

    Invariants:
    - Held-back text is exactly the longest suffix of the text fed so far that is a
      prefix of some stop string, so a partial match is never emitted early, and
      nothing else is held.
    - After a stop string matched, nothing more is emitted.
    """

    def __init__(self, stopping: StoppingParams, eos_token_ids: Collection[int], max_tokens: int,
                 guided: bool = False) -> None:
        self._min_tokens = stopping.min_tokens
        # A guided output that samples EOS ends (its matcher terminates), so ``ignore_eos`` keeps
        # EOS out of its sampling instead (G15), unless the request names it as a stop token; the
        # grammar still wins where EOS is all it allows (``Sampler._suppress``).
        self._masked_eos = (frozenset(eos_token_ids) - frozenset(stopping.stop_token_ids)
                            if guided and stopping.ignore_eos else frozenset())
        self._max_tokens = max_tokens  # resolved by the engine (context limit applied)
        self._include_stop = stopping.include_stop_in_output
        self._stop_token_ids = frozenset(stopping.stop_token_ids)
        self._eos_token_ids = frozenset() if stopping.ignore_eos else frozenset(eos_token_ids)
        stop_strings = tuple(dict.fromkeys(s for s in stopping.stop_strings if s))  # "" never matches
        self._automaton = _automaton(stop_strings) if stop_strings else None
        self._state = 0  # automaton state after all text fed so far
        self._held = ""  # == the text the state spells
        self._matched = False
        self._drop_token = False
        #: ``would_match``'s last held text, the pieces of it read, the protection, the state and the
        #: characters read: a held run's text grows, so the next call reads only the pieces it added
        self._peeked: tuple[HeldText, int, int, int, int] | None = None

    def check_token(self, token_id: int, num_output_tokens: int) -> FinishInfo | None:
        """Called after each sampled token (``num_output_tokens`` includes it)."""
        if num_output_tokens > self._min_tokens:
            finish = None
            if token_id in self._stop_token_ids:
                finish = FinishInfo(FinishReason.STOP, stop_token_id=token_id)
            elif token_id in self._eos_token_ids:
                finish = FinishInfo(FinishReason.STOP, eos_token_id=token_id)
            if finish is not None:
                self._drop_token = not self._include_stop
                return finish
        if num_output_tokens >= self._max_tokens:
            return FinishInfo(FinishReason.LENGTH)
        return None

    def suppressed_token_ids(self, num_output_tokens: int) -> frozenset[int]:
        """Token ids the sampler must mask for the next token (G15): while fewer than
        ``min_tokens`` tokens exist (``num_output_tokens`` = tokens so far), the ids
        that would stop the output; afterwards none, but a guided output's ignored EOS."""
        if num_output_tokens < self._min_tokens:
            return self._stop_token_ids | self._eos_token_ids | self._masked_eos
        return self._masked_eos

    @property
    def include_stop_in_output(self) -> bool:
        return self._include_stop

    @property
    def min_tokens(self) -> int:
        return self._min_tokens

    @property
    def should_drop_stop_token(self) -> bool:
        """Whether the stop token / EOS that ``check_token`` just matched is kept out of
        tokens and text (``include_stop_in_output`` false)."""
        return self._drop_token

    def feed_text(self, new_text: str, protected: int | None = 0) -> tuple[str, FinishInfo | None]:
        """Feed the next text delta; return the text now safe to emit, and the finish
        when a stop string completed in it (the emitted text then ends with the stop
        string when included, else right before it). No match ends in the first
        ``protected`` characters of ``new_text`` (None: in none of it): the text of the
        first ``min_tokens`` tokens."""
        if self._matched:
            return "", None
        if self._automaton is None:
            return new_text, None
        if new_text:
            self._peeked = None  # the state moves on
        automaton, state, match = self._automaton, self._state, self._automaton.match
        text = self._held + new_text
        first_open = len(text) if protected is None else len(self._held) + protected
        for i, ch in enumerate(new_text, start=len(self._held)):
            state = automaton.step(state, ch)
            stop = match[state]
            if stop is not None and i >= first_open:
                self._matched, self._held = True, ""
                end = i + 1 if self._include_stop else i + 1 - len(stop)
                return text[:end], FinishInfo(FinishReason.STOP, stop_text=stop)
        self._state = state
        cut = len(text) - automaton.depth[state]
        self._held = text[cut:]
        return text[:cut], None

    @property
    def has_strings(self) -> bool:
        """Whether the output has stop strings to match (a held byte run is decoded early only then)."""
        return self._automaton is not None

    def would_match(self, held: HeldText, protected: int | None = 0) -> bool:
        """Whether ``feed_text(str(held), protected)`` would complete a stop string (no state changes
        but a memo: the same held text, which matched nothing, grown since, reads on from where it
        ended, so a long held run costs each of its pieces once, not the whole text per token)."""
        if self._matched or self._automaton is None or protected is None:
            return False
        automaton, state, start, i = self._automaton, self._state, 0, 0
        if self._peeked is not None and self._peeked[0] is held and self._peeked[2] == protected:
            _, start, _, state, i = self._peeked
        for piece in held[start:]:
            for ch in piece:
                state = automaton.step(state, ch)
                if automaton.match[state] is not None and i >= protected:
                    return True
                i += 1
        self._peeked = (held, len(held), protected, state, i)
        return False

    def finish_text(self) -> str:
        """Held-back text to release when the output ends for another reason."""
        held, self._held, self._state = self._held, "", 0
        return held


@dataclass(frozen=True)
class TokenStep:
    """What one sampled token adds to its output's delta."""

    keep_token: bool  # the token belongs to the output (False: a dropped stop token / EOS)
    text: str  # append to the delta's text
    finish: FinishInfo | None  # set on the output's last step; nothing follows it
    num_detokenized_chars: int = 0  # text this token added before stop-string hold-back
    text_pending: bool = False  # its text is not decoded yet: it comes with a later token's
    num_chars_before: int = 0  # of num_detokenized_chars, those of earlier pending tokens (their text came now)
    #: Where an excluded stop string may cut the text: for the pending tokens whose text came now (then
    #: this one, when kept), where each one's own text ends in it (``IncrementalDetokenizer.token_ends``)
    token_ends: tuple[int, ...] | None = None


def process_token(
    stop: StopChecker, detokenizer: IncrementalDetokenizer | NoTextDetokenizer, token_id: int, num_output_tokens: int,
    forced_finish: FinishInfo | None = None,
) -> TokenStep:
    """Run one sampled token through stop checking and detokenization (steps 1-4 in
    the module docstring). ``num_output_tokens`` counts every sampled token, this one
    included, also a stop token that is then dropped. ``forced_finish`` ends the output
    with this token when no stop condition does (a grammar completed by its stop token,
    also with ``ignore_eos``); that token then counts as the matched stop (G14)."""
    finish = stop.check_token(token_id, num_output_tokens)
    if forced_finish is not None and (finish is None or finish.reason is FinishReason.LENGTH):
        finish = forced_finish  # the token completed the output: a STOP, even at max_tokens
        keep_token = stop.include_stop_in_output
    else:
        keep_token = finish is None or not stop.should_drop_stop_token
    text = detokenizer.add_token(token_id) if keep_token else ""
    before = detokenizer.num_chars_before_last if keep_token else 0
    # A held byte run that already completes a stop string: stop now. Ending the output here
    # makes the run's text final, so the match is exact (no later byte can change it). (``text``
    # is "" then: a token whose text came leaves none held.)
    string_stop = (finish is None and keep_token and stop.has_strings and detokenizer.holds_text
                   and detokenizer.ended_character
                   and stop.would_match(detokenizer.peek_final(), _protected(stop, detokenizer, held=True)))
    if (finish is not None or string_stop) and (flushed := detokenizer.flush()):
        text += flushed
        before = len(text)  # the run may reach into the flushed text: it ends with the output
    pending = detokenizer.holds_text
    # Only an excluded stop string drops tokens by where their text ends (found by review: a run's
    # tokens all ended with the run, so the stop dropped those of the text it kept too).
    cuts = stop.has_strings and not stop.include_stop_in_output and bool(text) and not pending
    ends = detokenizer.token_ends() if cuts else None
    emitted, string_finish = stop.feed_text(text, _protected(stop, detokenizer) if text else 0)
    if string_finish is not None:
        return TokenStep(keep_token, emitted, string_finish, len(text), pending, before, ends)
    if finish is not None:
        emitted += stop.finish_text()
    return TokenStep(keep_token, emitted, finish, len(text), pending, before, ends)


def _protected(stop: StopChecker, detokenizer: IncrementalDetokenizer | NoTextDetokenizer,
               held: bool = False) -> int | None:
    """Of the text released (``held``: still held), the characters the first ``min_tokens`` tokens made."""
    return detokenizer.chars_of_first(stop.min_tokens, held) if stop.min_tokens and stop.has_strings else 0
