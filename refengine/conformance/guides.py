"""The guided-decoding specs the suite sends: per ``GuidedDecodingMode`` one simple spec, a
verifier of outputs that follow it, and one invalid spec (X1).

The specs are small on purpose (a yes/no enum, up to three digits) so that a greedy model
finishes them in a few tokens whatever it would say unconstrained; a verifier still copes
with an output cut off by ``max_tokens`` where the grammar allows long ones (JSON): the
text must then be a prefix of a valid document (:mod:`json_prefix`).

``json_schema`` outputs are validated with the ``jsonschema`` package when it is importable;
without it, with a minimal check (an object, the required keys, enum values).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from refengine.conformance.enums import enum_name
from refengine.conformance.json_prefix import json_prefix_problem
from refengine.protocol import oe

try:  # a test dependency of refengine, not a requirement of the suite
    import jsonschema
except ImportError:  # pragma: no cover - exercised only where jsonschema is missing
    jsonschema = None

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
REGEX = "[0-9]{1,3}"
#: Sampling under a grammar that leaves the model many tokens (G17, G18): 3 to 6 lowercase words.
WORDS = "[a-z]+( [a-z]+){2,5}"
WORDS_PREFIX = "([a-z]+( [a-z]+){0,4}( [a-z]*)?)?"
CHOICES = ("yes", "no")
GRAMMAR = 'root ::= "yes" | "no"'
TAG_BEGIN, TAG_END = "<oeconf-value>", "</oeconf-value>"
#: The legacy (vLLM / SGLang) structural-tag form, which xgrammar-based servers take: free
#: text, in which the trigger would start a tagged integer. A greedy model rarely writes the
#: trigger, so this spec mostly checks acceptance; a triggered segment is verified.
STRUCTURAL_TAG = json.dumps({"type": "structural_tag", "triggers": [TAG_BEGIN],
                             "structures": [{"begin": TAG_BEGIN, "schema": {"type": "integer"}, "end": TAG_END}]})

Verifier = Callable[[str, bool], "str | None"]  # (output text, grammar completed) -> problem or None


def schema_problem(doc: Any, schema: dict[str, Any]) -> str | None:
    """What makes ``doc`` invalid against ``schema``; None when it is valid."""
    if jsonschema is not None:
        errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(doc), key=str)
        return f"not valid against the schema: {errors[0].message}" if errors else None
    if schema.get("type") == "object" and not isinstance(doc, dict):
        return f"not an object: {doc!r}"
    missing = [k for k in schema.get("required", []) if k not in doc]
    if missing:
        return f"required keys {missing} missing"
    for key, sub in schema.get("properties", {}).items():
        if key in doc and "enum" in sub and doc[key] not in sub["enum"]:
            return f"{key} = {doc[key]!r} is not one of {sub['enum']}"
    return None


def _json_document(text: str, complete: bool, schema: dict[str, Any]) -> str | None:
    if not complete:  # cut off by max_tokens: every prefix of a valid output is completable
        return json_prefix_problem(text, top="{")
    try:
        doc = json.loads(text)
    except ValueError as exc:
        return f"not JSON ({exc})"
    return schema_problem(doc, schema)


def verify_json_schema(text: str, complete: bool) -> str | None:
    return _json_document(text, complete, SCHEMA)


def verify_json_object(text: str, complete: bool) -> str | None:
    return _json_document(text, complete, {"type": "object"})


def verify_regex(text: str, complete: bool) -> str | None:
    return None if re.fullmatch(REGEX, text) else f"does not match {REGEX!r}"


def verify_words(text: str, complete: bool) -> str | None:
    pattern = WORDS if complete else WORDS_PREFIX  # cut off by max_tokens: a prefix of a match
    return None if re.fullmatch(pattern, text) else f"does not match {pattern!r}"


def verify_choice(text: str, complete: bool) -> str | None:
    return None if text in CHOICES else f"is not one of {list(CHOICES)}"


def verify_structural_tag(text: str, complete: bool) -> str | None:
    """Free text is fine; after the trigger, an integer up to the end tag."""
    at = text.find(TAG_BEGIN)
    if at < 0:
        return None
    segment = text[at + len(TAG_BEGIN):]
    end = segment.find(TAG_END)
    if end < 0:
        return json_prefix_problem(segment) if not complete else f"tag {TAG_BEGIN} never closed"
    body = segment[:end]
    try:
        value = json.loads(body)
    except ValueError:
        return f"the tagged segment {body!r} is not JSON"
    return None if isinstance(value, int) else f"the tagged segment {body!r} is not an integer"


def _set(field: str, value: str) -> Callable[[Any], None]:
    return lambda g: setattr(g, field, value)


def _choices(values: tuple[str, ...]) -> Callable[[Any], None]:
    def fill(g: Any) -> None:
        g.choice.SetInParent()  # an empty list must still select the oneof
        g.choice.choices.extend(values)

    return fill


@dataclass(frozen=True)
class GuideCase:
    """One mode: how to fill ``GuidedDecoding`` with a simple spec, how to verify an output,
    and an invalid spec (``None`` where the mode has no spec, json_object)."""

    mode: int
    fill: Callable[[Any], None]
    verify: Verifier
    max_tokens: int
    finite: bool  # every valid output is a few characters: the grammar itself must end it (STOP)
    invalid: Callable[[Any], None] | None = None
    invalid_what: str = ""

    @property
    def name(self) -> str:
        return enum_name(oe.GuidedDecodingMode, self.mode).removeprefix("GUIDED_DECODING_MODE_")


CASES: dict[int, GuideCase] = {c.mode: c for c in (
    GuideCase(oe.GUIDED_DECODING_MODE_JSON_SCHEMA, _set("json_schema", json.dumps(SCHEMA)), verify_json_schema, 24,
              False, _set("json_schema", '{"type": "object", "properties": {'), "a schema that is not JSON"),
    GuideCase(oe.GUIDED_DECODING_MODE_REGEX, _set("regex", REGEX), verify_regex, 8, True,
              _set("regex", "(ab"), "the regex '(ab' (unclosed group)"),
    GuideCase(oe.GUIDED_DECODING_MODE_EBNF_GRAMMAR, _set("ebnf_grammar", GRAMMAR), verify_choice, 8, True,
              _set("ebnf_grammar", 'root ::= ("yes" | "no"'), "an unbalanced grammar"),
    GuideCase(oe.GUIDED_DECODING_MODE_STRUCTURAL_TAG, _set("structural_tag", STRUCTURAL_TAG), verify_structural_tag,
              8, False, _set("structural_tag", '{"type": "structural_tag", "structures": ['),
              "a structural tag that is not JSON"),
    GuideCase(oe.GUIDED_DECODING_MODE_CHOICE, _choices(CHOICES), verify_choice, 8, True,
              _choices(()), "an empty choice list"),
    GuideCase(oe.GUIDED_DECODING_MODE_JSON_OBJECT, lambda g: g.json_object.SetInParent(), verify_json_object, 24,
              False),
)}

WORDS_CASE = GuideCase(oe.GUIDED_DECODING_MODE_REGEX, _set("regex", WORDS), verify_words, 16, False)

#: The mode names refengine uses in ``ModelInfo.extra["refengine.guided_backends"]`` (the oneof fields).
FIELD_MODES = {"json_schema": oe.GUIDED_DECODING_MODE_JSON_SCHEMA, "regex": oe.GUIDED_DECODING_MODE_REGEX,
               "ebnf_grammar": oe.GUIDED_DECODING_MODE_EBNF_GRAMMAR,
               "structural_tag": oe.GUIDED_DECODING_MODE_STRUCTURAL_TAG, "choice": oe.GUIDED_DECODING_MODE_CHOICE,
               "json_object": oe.GUIDED_DECODING_MODE_JSON_OBJECT}
