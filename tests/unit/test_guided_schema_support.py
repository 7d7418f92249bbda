"""A JSON schema guide never lets through a value the schema rejects: each backend either
enforces a keyword or refuses the schema (INVALID_ARGUMENT). The oracle is ``jsonschema``
(Draft 2020-12) on texts fed byte by byte (``test_guided_semantics.accepts_whole``); xgrammar
0.2.9 compiled the refused keywords below and ignored them (``sampling/guided/schema_support.py``)."""

from __future__ import annotations

import json

import pytest

from refengine.config import GuidedConfig
from refengine.sampling.guided import GuideCompiler, GuidedSpecError
from refengine.sampling.guided.schema_support import unenforced_use
from refengine.types import GuidedSpec, InvalidRequestError
from tests.unit.test_guided_engine import EOS, TOKENIZER, VOCAB, assert_idle, make_engine, prompt, request, tiny  # noqa: F401
from tests.unit.test_guided_semantics import BACKENDS, accepts_whole, valid_json

INT = {"type": "integer"}
#: (id, schema, texts: at least one the schema rejects, and one it accepts where there is one).
CASES = [
    ("not", {"type": "integer", "not": {"const": 3}}, ["3", "4"]),
    ("not-nested", {"type": "object", "properties": {"a": {"type": "integer", "not": {"const": 3}}},
                    "required": ["a"]}, ['{"a":3}', '{"a":4}']),
    ("if-then", {"type": "integer", "if": {"minimum": 5}, "then": {"multipleOf": 2}}, ["7", "8"]),
    ("if-else", {"type": "integer", "if": {"minimum": 5}, "else": {"const": 1}}, ["2", "1"]),
    ("contains", {"type": "array", "items": INT, "contains": {"const": 1}}, ["[2]", "[1]"]),
    ("uniqueItems", {"type": "array", "items": INT, "uniqueItems": True}, ["[1,1]", "[1,2]"]),
    ("dependentRequired", {"type": "object", "properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}},
     ['{"a":1}', '{"a":1,"b":2}']),
    ("dependentSchemas", {"type": "object", "properties": {"a": INT}, "dependentSchemas": {"a": {"required": ["b"]}}},
     ['{"a":1}']),
    ("allOf-two", {"allOf": [{"type": "object", "properties": {"a": INT}, "required": ["a"]},
                             {"type": "object", "properties": {"b": INT}, "required": ["b"]}]},
     ['{"a":1}', '{"a":1,"b":2}']),
    ("allOf-in-defs", {"$defs": {"X": {"allOf": [{"type": "integer", "minimum": 5}, {"maximum": 9}]}},
                       "$ref": "#/$defs/X"}, ["4", "6"]),
    ("required-unlisted", {"type": "object", "properties": {"a": INT}, "required": ["b"]},
     ['{"a":1}', '{"a":1,"b":2}']),
    ("multipleOf-number", {"type": "number", "multipleOf": 0.5}, ["0.3", "7.25", "1.5"]),
    ("multipleOf-number-by-integer", {"type": "number", "multipleOf": 2}, ["3", "3.5", "4"]),
]
#: Keywords that are data here (a property name, a const value), and forms xgrammar enforces.
ACCEPTED = [
    ("property-named-not", {"type": "object", "properties": {"not": INT, "if": INT}, "required": ["not"]},
     ['{"not":1}', '{"if":1}']),
    ("const-holding-keywords", {"const": {"allOf": [1, 2], "not": None}}, ['{"allOf":[1,2],"not":null}', "1"]),
    ("allOf-one-ref", {"$defs": {"X": {"type": "integer", "minimum": 5}}, "type": "object",
                       "properties": {"x": {"allOf": [{"$ref": "#/$defs/X"}], "description": "d"}}, "required": ["x"]},
     ['{"x":4}', '{"x":6}']),
    ("uniqueItems-false", {"type": "array", "items": INT, "uniqueItems": False}, ["[1,1]"]),
    ("multipleOf-integer", {"type": "integer", "multipleOf": 3}, ["4", "6"]),
    ("oneOf-disjoint", {"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"}, "x": INT},
                                   "required": ["kind", "x"], "additionalProperties": False},
                                  {"type": "object", "properties": {"kind": {"const": "b"}},
                                   "required": ["kind"], "additionalProperties": False}]},
     ['{"kind":"a","x":1}', '{"kind":"b"}', '{"kind":"a"}', '{"kind":"c"}']),
]


@pytest.fixture(scope="module")
def compiler() -> GuideCompiler:
    compiler = GuideCompiler(TOKENIZER, VOCAB, (EOS,), GuidedConfig())
    yield compiler
    compiler.close()


def _accepted(compiler: GuideCompiler, spec: GuidedSpec, text: str) -> bool:
    """The guide takes ``text`` compact or with ``", "`` / ``": "`` separators (backends differ)."""
    spaced = text.replace(",", ", ").replace(":", ": ")
    return accepts_whole(compiler, spec, text) or accepts_whole(compiler, spec, spaced)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("case", "schema", "texts"), CASES + ACCEPTED, ids=[c[0] for c in CASES + ACCEPTED])
def test_a_schema_guide_is_sound_or_refused(compiler, backend: str, case: str, schema: dict, texts: list) -> None:
    spec = GuidedSpec("json_schema", json.dumps(schema), backend=backend)
    try:
        compiler.compile(spec)
    except GuidedSpecError:
        assert case not in {c[0] for c in ACCEPTED} or backend != "xgrammar", f"xgrammar refused {case}"
        return
    unsound = [text for text in texts if _accepted(compiler, spec, text) and not valid_json(schema, text)]
    assert not unsound, f"{backend} takes texts the schema rejects: {unsound}"


@pytest.mark.parametrize(("case", "schema", "texts"), CASES, ids=[c[0] for c in CASES])
def test_xgrammar_refuses_keywords_it_would_ignore_naming_them(compiler, case: str, schema: dict, texts) -> None:
    keyword = unenforced_use(schema).split("'")[1]
    spec = GuidedSpec("json_schema", json.dumps(schema), backend="xgrammar")
    with pytest.raises(GuidedSpecError, match=f"xgrammar does not enforce '{keyword}'"):
        compiler.compile(spec)


@pytest.mark.parametrize(("case", "schema", "texts"), ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_xgrammar_compiles_what_it_enforces(compiler, case: str, schema: dict, texts) -> None:
    assert unenforced_use(schema) is None
    compiler.compile(GuidedSpec("json_schema", json.dumps(schema), backend="xgrammar"))


def test_the_refusal_reaches_the_client_as_invalid_argument_and_loses_nothing(tiny) -> None:  # noqa: F811
    engine = make_engine(tiny)
    schema = {"type": "object", "properties": {"a": {"type": "integer", "not": {"const": 3}}}}
    bad = request("not", GuidedSpec("json_schema", json.dumps(schema), backend="xgrammar"), prompt(1, 4))
    with pytest.raises(InvalidRequestError, match=r"'not' at #/properties/a"):
        engine.add_request(bad)
    assert not engine.has_unfinished_requests
    assert_idle(engine)


def _tag(schema: dict) -> str:
    """A structural tag: free text in which ``<f`` opens ``<f>`` JSON of ``schema`` ``</f>``."""
    return json.dumps({"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f"], "tags": [
        {"type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": schema}, "end": "</f>"}]}})


@pytest.mark.parametrize("backend", BACKENDS)
def test_structural_tag_schemas_are_sound_or_refused(compiler, backend: str) -> None:
    """The JSON-schema contents of a structural tag: an ignored keyword is refused by xgrammar,
    and a length-bounded string takes no raw TAB (strict JSON) on either backend."""
    ignored = GuidedSpec("structural_tag", _tag({"type": "integer", "not": {"const": 3}}), backend=backend)
    if backend == "xgrammar":
        with pytest.raises(GuidedSpecError, match=r"xgrammar does not enforce 'not' at #"):
            compiler.compile(ignored)
    else:
        try:
            compiler.compile(ignored)
        except GuidedSpecError:
            pass
        else:
            assert not accepts_whole(compiler, ignored, "<f>3</f>")
    bounded = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}, "required": ["a"]}
    spec = GuidedSpec("structural_tag", _tag(bounded), backend=backend)
    assert not _accepted(compiler, spec, 'say <f>{"a":"a\tb"}</f>')
    assert _accepted(compiler, spec, 'say <f>{"a":"ab"}</f> done')
