"""The second grammar backend: llguidance.

EBNF grammars are the same GBNF dialect as xgrammar's (converted to Lark by llguidance);
a structural tag must be of the triggered-tags kind (``structural_tag.py``), which maps
onto llguidance's own structural tags one to one. Matchers never raise for a bad token: they
enter an error state, which ``accept_token`` reports as False.

Every grammar runs without llguidance's forcing (``no_forcing``): where a grammar forces bytes,
llguidance offers the tokenizer's own tokenization of them, and the tokenizer reads text such as
``<s>`` or ``</s>`` as that special token, which the grammar then refuses as not being the text.
A guide spelling a special token's text (a choice ``"<s>"``, a regex ``a</s>b``) was accepted
and then failed every time. Without forcing, the mask offers every token the bytes allow, as
xgrammar's does.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import llguidance
import llguidance.hf
import torch

from refengine.sampling.guided import structural_tag
from refengine.sampling.guided.base import CompiledGuide, GrammarBackend, GuidedSpecError, GuideMatcher
from refengine.types import GuidedSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MODES = ("json_schema", "json_object", "regex", "ebnf_grammar", "structural_tag", "choice")


class _Matcher(GuideMatcher):
    """llguidance stops as soon as the grammar cannot continue, before any stop token; to
    end outputs the same way on both backends, it counts as terminated only once it has also
    accepted a stop token (its mask then allows only those).

    A token the grammar does not allow is refused without an ``error()`` (as on xgrammar): the
    core then reports a masking bug or a foreign first token, not a limit of the client's spec
    (found by review: llguidance's parser error for it read as "the guided spec hit a grammar
    limit", INVALID_ARGUMENT, not retryable); so is a stop token where the grammar cannot end."""

    def __init__(self, matcher: llguidance.LLMatcher, stop_token_ids: frozenset[int]) -> None:
        self._matcher = matcher
        self._stop_token_ids = stop_token_ids
        self._terminated = False
        self._rejected = False  # refused a token the grammar does not allow (not an error of the spec)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        # What llguidance.torch.fill_next_token_bitmask does, without importing that module:
        # it compiles a helper with torch.compile at import, which costs seconds of start-up.
        # The bitmask is a contiguous int32 CPU tensor (bitmask.allocate_bitmask).
        words = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def accept_token(self, token_id: int) -> bool:
        if self._terminated:
            return False
        if not self._matcher.is_error() and not self._allows(token_id):
            self._rejected = True
            return False
        accepted = self._matcher.consume_token(token_id) and not self._matcher.is_error()
        self._terminated = accepted and self._matcher.is_stopped() and token_id in self._stop_token_ids
        return accepted

    def _allows(self, token_id: int) -> bool:
        """Whether the grammar allows ``token_id`` now: a stop token where it may end (``validate_tokens``
        refuses one that ``consume_token`` accepts there), any other token as ``validate_tokens`` says."""
        if token_id in self._stop_token_ids:
            return self._matcher.is_accepting() or self._matcher.is_stopped()
        return self._matcher.validate_tokens([token_id]) > 0

    def is_terminated(self) -> bool:
        return self._terminated

    def error(self) -> str:
        # Its first line: what went wrong (a dump of the parser's state follows it).
        if self._rejected or not self._matcher.is_error():
            return ""
        return self._matcher.get_error().strip().splitlines()[0]


class _Compiled(CompiledGuide):
    """A matcher at the grammar's start; each output gets a deep copy (cheap), so the
    grammar is built once, at compile time, never on the step loop."""

    def __init__(self, template: llguidance.LLMatcher, stop_token_ids: frozenset[int]) -> None:
        self._template = template
        self._stop_token_ids = stop_token_ids

    def new_matcher(self) -> GuideMatcher:
        return _Matcher(self._template.deep_copy(), self._stop_token_ids)


def structural_tags(spec: str) -> list[llguidance.StructTag]:
    return [llguidance.StructTag(trigger=t.trigger, begin=t.begin, grammar=t.schema, end=t.end)
            for t in structural_tag.triggered_tags(structural_tag.parse(spec))]


class LlguidanceBackend(GrammarBackend):
    name = "llguidance"
    modes = MODES

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                       eos_token=list(stop_token_ids) or None)
        self._stop_token_ids = frozenset(stop_token_ids)

    def compile(self, spec: GuidedSpec) -> CompiledGuide:
        try:
            grammar = self._grammar(spec)
        except GuidedSpecError:
            raise
        except (ValueError, TypeError, KeyError, AssertionError, AttributeError, RecursionError) as exc:  # deep nesting
            raise GuidedSpecError(f"llguidance cannot compile this {spec.mode}: {exc}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise GuidedSpecError(f"llguidance cannot compile this {spec.mode}: {error}")
        template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)  # builds the grammar
        if template.is_error():
            raise GuidedSpecError(f"llguidance cannot compile this {spec.mode}: {template.get_error()}")
        return _Compiled(template, self._stop_token_ids)

    @staticmethod
    def _grammar(spec: GuidedSpec) -> str:
        return _without_forcing(LlguidanceBackend._llguidance_grammar(spec))

    @staticmethod
    def _llguidance_grammar(spec: GuidedSpec) -> str:
        if spec.mode == "json_schema":
            return llguidance.grammar_from("json_schema", _xgrammar_spacing(json.loads(spec.spec)))
        if spec.mode == "json_object":
            return llguidance.grammar_from("json_schema", _xgrammar_spacing({"type": "object"}))
        if spec.mode == "regex":
            return llguidance.grammar_from("regex", spec.spec)
        if spec.mode == "ebnf_grammar":
            return llguidance.grammar_from("gbnf", spec.spec)
        if spec.mode == "structural_tag":
            return llguidance.grammar_from("lark", llguidance.StructTag.to_grammar(structural_tags(spec.spec),
                                                                                  assume_special=False))
        return llguidance.grammar_from("choice", json.dumps(list(spec.choices)))


#: xgrammar's spacing (``any_whitespace=False``): one space after ``,`` and ``:``, none elsewhere.
#: llguidance's default allowed any whitespace between tokens, so its JSON differed from
#: xgrammar's for the same spec, and a model could loop on newlines (found by review).
_SPACING = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _xgrammar_spacing(schema: object) -> str:
    if isinstance(schema, dict) and "x-guidance" not in schema:
        schema = {**schema, "x-guidance": _SPACING}
    return json.dumps(schema)


NO_FORCING = '%llguidance {"no_forcing": true}\n'


def _without_forcing(grammar: str) -> str:
    """``grammar`` (what ``llguidance.grammar_from`` gives: a Lark grammar, or a top-level JSON
    holding one Lark grammar or JSON schema) as a Lark grammar with forcing off."""
    if grammar.lstrip().startswith("{"):
        (entry,) = json.loads(grammar)["grammars"]
        grammar = entry.get("lark_grammar") or "start: %json " + json.dumps(entry["json_schema"])
    return llguidance.grammar_from("lark", NO_FORCING + grammar)
