"""Independent oracles for grammar-constrained outputs (tests only).

Nothing here imports refengine: the checks use the xgrammar library directly, the
``jsonschema`` package and a hand-written parser, so an engine bug cannot hide behind
shared code.

- ``allowed_token_ids`` / ``GrammarOracle``: what a fresh xgrammar ``GrammarMatcher``
  allows after a token prefix (for "masked tokens report -inf" checks).
- ``GrammarOracle.complete``: feeds a prefix that an output cut by ``max_tokens`` ended
  with, asserts the grammar accepts it token by token, then finishes it by the grammar
  alone (a deterministic, bounded walk that prefers closing the structure) and returns
  the whole text, which the caller then validates (jsonschema, ``re.fullmatch``, ...).
- ``parse_arithmetic``: a recursive-descent parser for ``ARITHMETIC_GBNF``.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Callable

import jsonschema
import torch
import xgrammar

# Numbers, + - * /, parentheses; no whitespace (xgrammar's GBNF dialect).
ARITHMETIC_GBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+ ("." [0-9]+)?
"""

# What the completion walk prefers, best first (after ending the grammar): close a string
# (with a backslash first where the quote must be escaped, as in an e-mail's quoted local
# part), "@" (an e-mail's local part admits "}"; outside strings "@" is never allowed), close
# what is open, end a value, then digits before the rest ("0" first: "50." completes to
# "50.0", within a maximum of 50).
_PREFERRED = ['"', "\\", "@", "}", "]", ")", ",", ".", *"0123456789"]


def without_number_bounds(schema):
    """``schema`` with minimum/maximum dropped from ``"type": "number"`` schemas (not integers).

    xgrammar 0.2.9 compiles a bounded number to a grammar of at most 6 fraction digits, so it
    rejects e.g. 52.4438546 for maximum 100, which the schema (and llguidance) allows. Replaying
    another backend's tokens needs the unbounded grammar; the bounds are then checked on the
    completed text by jsonschema."""
    if isinstance(schema, list):
        return [without_number_bounds(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    relaxed = {k: without_number_bounds(v) for k, v in schema.items()}
    if relaxed.get("type") == "number":
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            relaxed.pop(key, None)
    return relaxed


def json_validator(schema: dict) -> jsonschema.protocols.Validator:
    """A Draft 2020-12 validator that also checks ``format`` (uuid, email, ...)."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    cls.check_schema(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def bitmask_to_ids(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Row 0 of an xgrammar int32 bitmask as a bool tensor over the vocabulary."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask[0].unsqueeze(1) >> shifts) & 1
    return bits.flatten()[:vocab_size].bool()


@functools.cache
def _token_ranks(tokenizer, vocab_size: int) -> torch.Tensor:
    """A static preference per token id for the completion walk (lower = preferred)."""
    ranks = torch.empty(vocab_size, dtype=torch.float64)
    preferred = {c: i for i, c in enumerate(_PREFERRED)}
    for token_id in range(vocab_size):
        text = tokenizer.decode([token_id]) if token_id < len(tokenizer) else ""
        if text in preferred:
            rank = preferred[text]
        elif len(text) == 1 and text.isascii() and text.isalnum():
            rank = 20 + ord(text) / 1000
        elif len(text) == 1 and text.isascii() and text.isprintable() and text != " ":
            rank = 40 + ord(text) / 1000
        elif text and text.isascii() and text.isprintable() and not text.isspace():
            rank = 100 + len(text) + token_id / 1e6
        elif text and text.isspace():
            rank = 500 + token_id / 1e6
        else:
            rank = 1000 + token_id / 1e6
        ranks[token_id] = rank
    return ranks


class GrammarOracle:
    """xgrammar, used directly, for one tokenizer: compiles grammars and replays outputs."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(self.info)
        self.stop_token_ids = tuple(self.info.stop_token_ids)

    # Compiled with the most permissive whitespace: a backend may emit any JSON whitespace;
    # ``relax_number_bounds``: see ``without_number_bounds``.
    def json_schema(self, schema: dict | str, relax_number_bounds: bool = False) -> xgrammar.CompiledGrammar:
        if relax_number_bounds:
            schema = without_number_bounds(json.loads(schema) if isinstance(schema, str) else schema)
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return self.compiler.compile_json_schema(text, any_whitespace=True)

    def json_object(self) -> xgrammar.CompiledGrammar:
        return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=True, strict_mode=False)

    def regex(self, pattern: str) -> xgrammar.CompiledGrammar:
        return self.compiler.compile_regex(pattern)

    def ebnf(self, grammar: str) -> xgrammar.CompiledGrammar:
        return self.compiler.compile_grammar(grammar)

    def structural_tag(self, spec: str) -> xgrammar.CompiledGrammar:
        return self.compiler.compile_structural_tag(spec)

    def matcher_after(self, compiled: xgrammar.CompiledGrammar, token_ids: list[int]) -> xgrammar.GrammarMatcher:
        """A fresh matcher that accepted ``token_ids``; fails naming the first rejected token."""
        matcher = xgrammar.GrammarMatcher(compiled)
        for position, token_id in enumerate(token_ids):
            assert matcher.accept_token(token_id), (
                f"grammar rejects token {token_id} ({self.tokenizer.decode([token_id])!r}) at position "
                f"{position} after {self.tokenizer.decode(token_ids[:position])!r}")
        return matcher

    def allowed(self, matcher: xgrammar.GrammarMatcher) -> torch.Tensor:
        """Bool tensor over the vocabulary: the tokens the matcher accepts next."""
        bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        return bitmask_to_ids(bitmask, self.vocab_size)

    def allowed_after(self, compiled: xgrammar.CompiledGrammar, token_ids: list[int]) -> list[torch.Tensor]:
        """The allowed-token set before each of ``token_ids`` and after the last one."""
        matcher = xgrammar.GrammarMatcher(compiled)
        sets = []
        for token_id in token_ids:
            sets.append(self.allowed(matcher))
            assert matcher.accept_token(token_id), f"grammar rejects token {token_id}"
        sets.append(self.allowed(matcher))
        return sets

    def complete(self, compiled: xgrammar.CompiledGrammar, prefix_ids: list[int],
                 check: Callable[[str], object] | None = None, max_steps: int = 400) -> str:
        """Accept ``prefix_ids`` (asserted), finish the text by the grammar alone and return
        the whole text, one that ``check`` (raising on an invalid text) accepts.

        A deterministic walk first; should it loop or its text fail ``check``, a few seeded
        walks that sometimes take a random allowed token instead (all bounded). The prefix is
        valid when some completion is: the assertion lists every walk's outcome."""
        start = self.matcher_after(compiled, prefix_ids)
        ranks = _token_ranks(self.tokenizer, self.vocab_size).clone()
        for stop in self.stop_token_ids:
            ranks[stop] = -1.0
        outcomes = []
        for seed in (None, 1, 2, 3, 4, 5):
            text = self._walk(start.fork(), prefix_ids, ranks, max_steps, seed)
            if text is None:
                outcomes.append(f"no end within {max_steps} steps")
                continue
            try:
                if check is not None:
                    check(text)
            except (AssertionError, ValueError, jsonschema.ValidationError) as exc:  # ValueError: json.loads
                outcomes.append(f"{text!r}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                continue
            return text
        raise AssertionError(f"no valid completion of {self.tokenizer.decode(prefix_ids)!r}: " + "; ".join(outcomes))

    def _walk(self, matcher: xgrammar.GrammarMatcher, prefix_ids: list[int], ranks: torch.Tensor, max_steps: int,
              seed: int | None) -> str | None:
        rng = random.Random(seed)
        ids = list(prefix_ids)
        for _ in range(max_steps):
            if matcher.is_terminated():
                return self.tokenizer.decode(ids)
            allowed = self.allowed(matcher)
            assert allowed.any(), f"grammar allows nothing after {self.tokenizer.decode(ids)!r}"
            if seed is not None and rng.random() < 0.25:
                candidates = allowed.nonzero().flatten().tolist()
                token_id = candidates[rng.randrange(len(candidates))]
            else:
                token_id = int(torch.where(allowed, ranks, torch.inf).argmin())
            assert matcher.accept_token(token_id)
            if token_id not in self.stop_token_ids:
                ids.append(token_id)
        return None


# ----------------------------------------------------------------------------- arithmetic


class _Arithmetic:
    """expr := term (("+"|"-") term)*; term := factor (("*"|"/") factor)*;
    factor := number | "(" expr ")"; number := digits ("." digits)?"""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def expr(self) -> None:
        self.term()
        while self.peek() in ("+", "-") and self.peek():
            self.pos += 1
            self.term()

    def term(self) -> None:
        self.factor()
        while self.peek() in ("*", "/") and self.peek():
            self.pos += 1
            self.factor()

    def factor(self) -> None:
        if self.peek() == "(":
            self.pos += 1
            self.expr()
            if self.peek() != ")":
                raise ValueError(f"expected ')' at {self.pos} in {self.text!r}")
            self.pos += 1
        else:
            self.number()

    def digits(self) -> None:
        start = self.pos
        while self.peek() and self.peek() in "0123456789":
            self.pos += 1
        if self.pos == start:
            raise ValueError(f"expected a digit at {self.pos} in {self.text!r}")

    def number(self) -> None:
        self.digits()
        if self.peek() == ".":
            self.pos += 1
            self.digits()


def parse_arithmetic(text: str) -> bool:
    """True when ``text`` is exactly one expression of ``ARITHMETIC_GBNF``."""
    parser = _Arithmetic(text)
    try:
        parser.expr()
    except ValueError:
        return False
    return parser.pos == len(text)
