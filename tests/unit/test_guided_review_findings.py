"""Guided-decoding defects found by review, each test failing before its fix (xgrammar unless
said): a literal quote or backslash in a JSON-Schema ``pattern`` (or a ``patternProperties``
key) came out unescaped inside the JSON string; a regex class opening with ``]`` (``[^]a]``)
meant "any character"; keywords beside ``$ref``, a combinator, ``enum`` or ``const`` were
dropped, and an anchor or remote ``$ref`` meant "any JSON"; llguidance let JSON outputs hold
unbounded whitespace where xgrammar allows none. Each case is now enforced or refused
(INVALID_ARGUMENT), judged by ``jsonschema`` and ``re.fullmatch``."""
from __future__ import annotations

import json
import re

import pytest

from refengine.sampling.guided import GuidedSpecError
from refengine.types import GuidedSpec
from tests.unit.test_guided_schema_support import _accepted
from tests.unit.test_guided_semantics import BACKENDS, accepts_whole, compiler, valid_json  # noqa: F401


def sound_or_refused(compiler, mode: str, spec_text: str, backend: str, texts, ok) -> list[str]:  # noqa: F811
    spec = GuidedSpec(mode, spec_text, backend=backend)
    try:
        compiler.compile(spec)
    except GuidedSpecError:
        return []
    return [t for t in texts if _accepted(compiler, spec, t) and not ok(t)]


def obj_s(pattern: str) -> dict:
    return {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "required": ["s"],
            "additionalProperties": False}


# F1: a literal '"' or '\' in a JSON-schema pattern is emitted raw inside the JSON string.
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("schema", "texts"), [
    (obj_s('^"$'), ['{"s":"""}', '{"s":"\\""}']),
    (obj_s('^\\\\$'), ['{"s":"\\"}', '{"s":"\\\\"}']),
    (obj_s('^[a-z]+\\\\[a-z]+$'), ['{"s":"dir\\file"}', '{"s":"dir\\\\file"}']),
    ({"type": "object", "patternProperties": {'^"$': {"type": "integer"}}, "additionalProperties": False},
     ['{""":1}', '{"\\"":1}']),
    (obj_s('^\\x22$'), ['{"s":"""}', '{"s":"\\""}']),
], ids=["quote", "backslash", "windows-path", "patternProperties-key", "quote-as-hex-escape"])
def test_schema_pattern_with_quote_or_backslash_gives_valid_json(compiler, backend, schema, texts) -> None:  # noqa: F811
    bad = sound_or_refused(compiler, "json_schema", json.dumps(schema), backend, texts, lambda t: valid_json(schema, t))
    assert not bad, f"{backend} emits invalid JSON: {bad}"


# F2: regex_for_xgrammar passes a class opening with ']' ("[^]a]") unchanged; xgrammar reads "[^]" as any character.
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("pattern", "texts"), [(r"[^]a]{2}", ["xa]]", "bc"]), (r"[^]]", ["]]", "x]", "x"])])
def test_class_opening_with_a_bracket_means_what_python_re_means(compiler, backend, pattern, texts) -> None:  # noqa: F811
    bad = sound_or_refused(compiler, "regex", pattern, backend, texts, lambda t: re.fullmatch(pattern, t))
    assert not bad, f"{backend} takes {bad}, which {pattern!r} does not fullmatch"


# F3: xgrammar drops keywords beside $ref / anyOf / oneOf / allOf / enum / const, and compiles an
# unresolvable $ref (anchor, remote) to "any JSON".
SIBLINGS = [
    ({"$defs": {"p": {"type": "integer"}}, "$ref": "#/$defs/p", "minimum": 5, "maximum": 7}, ["1", "6"]),
    ({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "enum": ["a", "b"]}, ['"zzz"', '"a"']),
    ({"allOf": [{"type": "integer", "minimum": 5}], "maximum": 6}, ["9", "6"]),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}], "minimum": 5}, ["1", "7"]),
    ({"oneOf": [{"type": "integer"}, {"type": "boolean"}], "maximum": 3}, ["9", "2"]),
    ({"type": "integer", "enum": [1, 2, "x"]}, ['"x"', "1"]),
    ({"enum": [1, 2, 30], "maximum": 5}, ["30", "2"]),
    ({"const": 30, "maximum": 5}, ["30"]),
    ({"type": "string", "enum": ["abc", "d"], "maxLength": 1}, ['"abc"', '"d"']),
    ({"$defs": {"p": {"$anchor": "pp", "type": "boolean"}}, "$ref": "#pp"}, ["1", "true"]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "patternProperties": {"^a$": {"minimum": 5}}},
     ['{"a": 1}', '{"a": 6}']),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("schema", "texts"), SIBLINGS, ids=[json.dumps(s)[:40] for s, _ in SIBLINGS])
def test_keywords_beside_ref_combinators_enum_const_are_enforced_or_refused(compiler, backend, schema, texts) -> None:  # noqa: F811
    bad = sound_or_refused(compiler, "json_schema", json.dumps(schema), backend, texts, lambda t: valid_json(schema, t))
    assert not bad, f"{backend} takes texts the schema rejects: {bad}"


# F5 (low): llguidance lets JSON schema / json_object outputs hold unbounded whitespace; xgrammar does not.
@pytest.mark.parametrize("mode", ["json_schema", "json_object"])
def test_backends_agree_on_json_spacing(compiler, mode) -> None:  # noqa: F811
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    text = '{' + "\n" * 200 + '"a": 1}'
    got = {b: accepts_whole(compiler, GuidedSpec(mode, schema if mode == "json_schema" else "", backend=b), text)
           for b in BACKENDS}
    assert len(set(got.values())) == 1, got


# What the refusals above must not take with them (found by reviewing them): a negated class
# keeping quotes or backslashes out, and keys beside $ref or enum that constrain nothing.
NOT_REFUSED = [
    (obj_s('^[^"]*$'), '{"s": "ab"}', '{"s": "a\\"b"}'),
    (obj_s('^[^"\\\\]+$'), '{"s": "ab"}', '{"s": "a\\\\b"}'),
    ({"$defs": {"c": {"type": "string", "enum": ["r", "g"]}}, "$ref": "#/$defs/c", "x-order": 1}, '"r"', '"b"'),
    ({"type": "string", "enum": ["r", "g"], "nullable": True}, '"g"', '"b"'),
    ({"$defs": {"c": {"type": "integer"}}, "$ref": "#/$defs/c", "example": 3}, "3", '"3"'),
]


@pytest.mark.parametrize(("schema", "valid", "invalid"), NOT_REFUSED, ids=["no-quote", "no-quote-or-backslash",
                                                                           "x-order", "nullable", "example"])
def test_what_xgrammar_enforces_is_not_refused(compiler, schema, valid: str, invalid: str) -> None:  # noqa: F811
    spec = GuidedSpec("json_schema", json.dumps(schema), backend="xgrammar")
    compiler.compile(spec)  # not refused
    assert _accepted(compiler, spec, valid) and valid_json(schema, valid)
    assert not _accepted(compiler, spec, invalid) and not valid_json(schema, invalid)
