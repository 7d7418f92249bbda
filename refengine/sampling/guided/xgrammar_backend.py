"""The default grammar backend: xgrammar (all six modes).

EBNF grammars use xgrammar's GBNF dialect (``root ::= ...``); a choice list becomes a
grammar of quoted alternatives; ``json_object`` is xgrammar's built-in JSON grammar
restricted to an object at the top (a JSON Schema ``{"type": "object"}``).

Where xgrammar 0.2.9 departs from what a guide means, this backend corrects it, so both
backends (and the oracles users check outputs with) agree:
- special tokens (``<|im_start|>``, ``<unk>``, reserved ones) are never allowed in a JSON
  schema, JSON object, regex or choice: xgrammar detects none in a Hugging Face vocabulary
  and treats them as their literal text, so they appeared inside JSON strings and regex
  matches (llguidance never allows them). EBNF grammars and structural tags keep them: they
  may spell a model's control tokens;
- a regex's ``.`` matches any character but a newline, as in Python's ``re``, Rust's regex
  (llguidance) and JSON Schema's ECMA-262 (xgrammar's matched ``\n`` too); ``\\A`` and
  ``\\Z`` anchor, and a letter escape xgrammar does not know is refused (it matched the letter);
- a JSON schema using a keyword xgrammar compiles but ignores (``not``, ``if``, ``contains``,
  an ``allOf`` of several subschemas...) is refused (``schema_support``);
- no output holds a UTF-16 surrogate's bytes, which xgrammar read as a code point (``utf8_guard``);
- a JSON string bounded by ``minLength``/``maxLength`` holds unescaped JSON characters:
  xgrammar's bounded repeat admitted raw control characters (a TAB: invalid JSON, xgrammar
  issue #800). It takes no escape there either (so no ``"`` or ``\\`` inside such a string):
  allowing escapes made its masks inside the string ~600x slower (see ``_JSON_CHAR``); llguidance
  takes them.
The last two hold for the JSON-schema contents of structural tags as well.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import xgrammar

from refengine.sampling.guided import structural_tag
from refengine.sampling.guided.base import CompiledGuide, GrammarBackend, GuidedSpecError, GuideMatcher
from refengine.sampling.guided.schema_support import unenforced_use
from refengine.sampling.guided.utf8_guard import SurrogateGuard
from refengine.types import GuidedSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_LOG_PREFIX = re.compile(r"\[\d{2}:\d{2}:\d{2}\] \S+:\d+: ")
# The rule xgrammar 0.2.9 writes for one character of a length-bounded JSON string, and the
# unescaped JSON character (RFC 8259) it becomes; a later xgrammar that writes another rule is
# left alone. Not escapes too: any body but one character class made xgrammar's masks inside the
# string ~600x slower (8 ms a token against 13 µs, benchmarks/guided.py), whatever the form
# (inline, its own rule, nested rules instead of the bounded repeat, no \u escapes).
_BOUNDED_STRING_CHAR = re.compile(r'^(\w+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
_JSON_CHAR = r'(([^\0-\x1f\"\\]))'
#: The letter escapes xgrammar 0.2.9 reads as Python does (classes, control characters) or
#: refuses itself (``\\b``, ``\\B``, ``\\p``, ``\\P``, ``\\k``, ``\\c``) or reads with arguments
#: (``\\x``, ``\\u``); ``\\e`` is ESC, as in PCRE. Probed letter by letter.
_XGRAMMAR_LETTER_ESCAPES = frozenset("adDefnrsStvwWbBpPkcxu")
MODES = ("json_schema", "json_object", "regex", "ebnf_grammar", "structural_tag", "choice")


class _Matcher(GuideMatcher):
    def __init__(self, compiled: xgrammar.CompiledGrammar, guard: SurrogateGuard) -> None:
        self._matcher = xgrammar.GrammarMatcher(compiled)
        self._guard = guard
        self._after_lead = False  # the last token ended on the byte ED: a surrogate could follow

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)
        self._guard.restrict(bitmask[row], self._after_lead)

    def accept_token(self, token_id: int) -> bool:
        accepted = self._matcher.accept_token(token_id)
        self._after_lead = accepted and token_id in self._guard.ends_on_lead
        return accepted

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class _Compiled(CompiledGuide):
    def __init__(self, compiled: xgrammar.CompiledGrammar, guard: SurrogateGuard) -> None:
        self._compiled = compiled
        self._guard = guard

    def new_matcher(self) -> GuideMatcher:
        return _Matcher(self._compiled, self._guard)

    @property
    def memory_bytes(self) -> int:
        return self._compiled.memory_size_bytes


def _message(exc: Exception) -> str:
    """xgrammar's error text without its C++ log prefix (``[12:00:00] /project/cpp/x.cc:12: ``)."""
    return _LOG_PREFIX.sub("", str(exc)).strip()


def choice_grammar(choices: tuple[str, ...]) -> str:
    """``root ::= "a" | "b"``; json.dumps gives GBNF-compatible escapes for quotes and backslashes.
    Non-ASCII stays as it is: GBNF reads a ``\\uXXXX`` escape as one code point, so the surrogate
    pair json.dumps writes for an emoji would be two (broken) characters."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def special_token_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The tokenizer's special tokens: its named ones and every added token marked special
    (what llguidance reads from the same tokenizer as special)."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return set(tokenizer.all_special_ids) | {i for i, token in added.items() if getattr(token, "special", False)}


def without_special_tokens(info: xgrammar.TokenizerInfo, special: set[int]) -> xgrammar.TokenizerInfo:
    """``info`` with the ``special`` tokens marked special, which xgrammar never allows as text:
    it marks a token special when its text is empty. A special stop token (``</s>``) is blanked
    too: xgrammar still ends the guide on it by id, but with its text kept it also spelled the
    literal ``</s>`` a guide asked for, and ended the output there, empty."""
    if not special:
        return info
    vocab = [b"" if i in special else text for i, text in enumerate(info.decoded_vocab)]
    return xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=info.vocab_size,
                                  stop_token_ids=info.stop_token_ids, add_prefix_space=info.add_prefix_space)


def regex_for_xgrammar(pattern: str) -> str:
    """``pattern`` as xgrammar should read it:

    - each ``.`` outside a character class as ``[^\\n]``: the ``.`` of Python, Rust and
      ECMA-262 regexes, where xgrammar's also matches a newline;
    - a leading ``\\A`` and a trailing ``\\Z`` or ``\\z`` dropped: the whole output matches
      anyway, and xgrammar reads them as the letters A, Z and z;
    - any other letter escape xgrammar does not know (``\\G``, ``\\h``, ``\\y``...) refused:
      xgrammar matches the letter itself, which the pattern's author did not mean.
    """
    out, in_class, i = [], False, 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":  # an escape, whatever follows (``\\.`` is a literal dot)
            escape = pattern[i:i + 2]
            if escape[1:].isascii() and escape[1:].isalpha() and escape[1] not in _XGRAMMAR_LETTER_ESCAPES:
                if not _is_edge_anchor(escape, i, len(pattern), in_class):
                    raise GuidedSpecError(f"regex escape {escape} at position {i} is not supported by the "
                                          "xgrammar backend (it would match the letter itself)")
            else:
                out.append(escape)
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
            # A ``]`` first in the class (after an optional ``^``) is a literal, not its end.
            start = i + 2 if pattern.startswith("^", i + 1) else i + 1
            if pattern.startswith("]", start):
                out.append(pattern[i:start] + "\\]")  # xgrammar reads "[]" and "[^]" as a whole class
                i = start + 1
                continue
        elif char == ".":
            char = "[^\\n]"
        out.append(char)
        i += 1
    return "".join(out)


def _is_edge_anchor(escape: str, position: int, length: int, in_class: bool) -> bool:
    return not in_class and ((escape == "\\A" and position == 0)
                             or (escape in ("\\Z", "\\z") and position + 2 == length))


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"
    modes = MODES

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids))
        # xgrammar's own cache is off: refengine's compile cache is the one, bounded, cache.
        # Grammars and structural tags may spell a model's control tokens (``<|python_tag|>``),
        # so they keep them; the text modes (schemas, regexes, choices) never allow them.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._guard = SurrogateGuard(info.decoded_vocab, vocab_size)
        self._text_compiler = xgrammar.GrammarCompiler(without_special_tokens(info, special_token_ids(tokenizer)),
                                                       max_threads=1, cache_enabled=False)

    def compile(self, spec: GuidedSpec) -> CompiledGuide:
        try:
            return _Compiled(self._compile(spec), self._guard)
        except GuidedSpecError:
            raise
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors for a bad spec
            # Some refusals carry no text (a schema number past float range: 1e400).
            reason = _message(exc) or "xgrammar gave no reason (a number out of range?)"
            raise GuidedSpecError(f"xgrammar cannot compile this {spec.mode}: {reason}") from None

    def _compile(self, spec: GuidedSpec) -> xgrammar.CompiledGrammar:
        compiler = self._text_compiler
        if spec.mode == "json_schema":
            _refuse_unenforced(json.loads(spec.spec))  # json.loads: a clear "not JSON" error first
            return _with_json_characters(
                xgrammar.Grammar.from_json_schema(spec.spec, any_whitespace=False), compiler,
                lambda: compiler.compile_json_schema(spec.spec, any_whitespace=False))
        if spec.mode == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.mode == "regex":
            return compiler.compile_regex(regex_for_xgrammar(spec.spec))
        if spec.mode == "ebnf_grammar":
            return self._compiler.compile_grammar(spec.spec)
        if spec.mode == "structural_tag":
            return self._compile_structural_tag(structural_tag.parse(spec.spec))
        return compiler.compile_grammar(choice_grammar(spec.choices))

    def _compile_structural_tag(self, tag: dict[str, Any]) -> xgrammar.CompiledGrammar:
        """Its JSON-schema contents checked and corrected as a json_schema guide's are."""
        current = json.dumps(tag if "format" in tag else structural_tag.legacy_to_current(tag))
        for schema in structural_tag.json_schemas(json.loads(current)):
            _refuse_unenforced(schema)
        return _with_json_characters(xgrammar.Grammar.from_structural_tag(current), self._compiler,
                                     lambda: self._compiler.compile_structural_tag(current))


def _refuse_unenforced(schema: Any) -> None:
    unenforced = unenforced_use(schema)
    if unenforced is not None:
        raise GuidedSpecError(f"xgrammar does not enforce {unenforced}: refused rather than produce output "
                              "the schema rejects (llguidance enforces some such keywords)")


def _with_json_characters(grammar: xgrammar.Grammar, compiler: xgrammar.GrammarCompiler,
                          as_is: Callable[[], xgrammar.CompiledGrammar]) -> xgrammar.CompiledGrammar:
    """``grammar`` with its length-bounded JSON strings made of JSON characters (see the module
    docstring), compiled; a grammar without such strings compiles ``as_is``."""
    fixed, count = _BOUNDED_STRING_CHAR.subn(lambda m: f"{m.group(1)} ::= {_JSON_CHAR}", str(grammar))
    return compiler.compile_grammar(fixed) if count else as_is()
