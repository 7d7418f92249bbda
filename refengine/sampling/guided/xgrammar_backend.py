"""The default grammar backend: xgrammar (all six modes).

EBNF grammars use xgrammar's GBNF dialect (``root ::= ...``); a choice list becomes a
grammar of quoted alternatives; ``json_object`` is xgrammar's built-in JSON grammar
restricted to an object at the top (a JSON Schema ``{"type": "object"}``).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

import torch
import xgrammar

from refengine.sampling.guided import structural_tag
from refengine.sampling.guided.base import CompiledGuide, GrammarBackend, GuidedSpecError, GuideMatcher
from refengine.types import GuidedSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_LOG_PREFIX = re.compile(r"\[\d{2}:\d{2}:\d{2}\] \S+:\d+: ")
MODES = ("json_schema", "json_object", "regex", "ebnf_grammar", "structural_tag", "choice")


class _Matcher(GuideMatcher):
    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        self._matcher = xgrammar.GrammarMatcher(compiled)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class _Compiled(CompiledGuide):
    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        self._compiled = compiled

    def new_matcher(self) -> GuideMatcher:
        return _Matcher(self._compiled)


def _message(exc: Exception) -> str:
    """xgrammar's error text without its C++ log prefix (``[12:00:00] /project/cpp/x.cc:12: ``)."""
    return _LOG_PREFIX.sub("", str(exc)).strip()


def choice_grammar(choices: tuple[str, ...]) -> str:
    """``root ::= "a" | "b"``; json.dumps gives GBNF-compatible escapes for quotes and backslashes.
    Non-ASCII stays as it is: GBNF reads a ``\\uXXXX`` escape as one code point, so the surrogate
    pair json.dumps writes for an emoji would be two (broken) characters."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"
    modes = MODES

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids))
        # xgrammar's own cache is off: refengine's compile cache is the one, bounded, cache.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, spec: GuidedSpec) -> CompiledGuide:
        try:
            return _Compiled(self._compile(spec))
        except GuidedSpecError:
            raise
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors for a bad spec
            raise GuidedSpecError(f"xgrammar cannot compile this {spec.mode}: {_message(exc)}") from None

    def _compile(self, spec: GuidedSpec) -> xgrammar.CompiledGrammar:
        compiler = self._compiler
        if spec.mode == "json_schema":
            json.loads(spec.spec)  # a clear "not JSON" error before xgrammar's
            return compiler.compile_json_schema(spec.spec, any_whitespace=False)
        if spec.mode == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.mode == "regex":
            return compiler.compile_regex(spec.spec)
        if spec.mode == "ebnf_grammar":
            return compiler.compile_grammar(spec.spec)
        if spec.mode == "structural_tag":
            tag = structural_tag.parse(spec.spec)
            return compiler.compile_structural_tag(json.dumps(tag if "format" in tag
                                                              else structural_tag.legacy_to_current(tag)))
        return compiler.compile_grammar(choice_grammar(spec.choices))
