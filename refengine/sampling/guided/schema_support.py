"""JSON Schema keywords xgrammar 0.2.9 compiles but does not enforce.

xgrammar builds its grammar from the keywords it knows and skips the others without a word, so
a schema using one compiled into a guide whose output the schema rejects. Probed on this
project's pinned xgrammar, each guide judged by ``jsonschema`` (``tests/unit/test_guided_schema_support.py``):

- ``not``, ``if`` / ``then`` / ``else``, ``contains`` (and ``minContains`` / ``maxContains``),
  ``uniqueItems``, ``dependentRequired``, ``dependentSchemas`` and draft 7's ``dependencies``
  were ignored (``{"not": {"const": 3}}`` let 3 through);
- ``allOf`` of two or more subschemas kept one of them (``{"a": 1}`` passed an ``allOf`` that
  also required ``b``); a single one, the form tools generate around a ``$ref``, is enforced;
- a ``required`` name missing from ``properties`` was not required;
- ``multipleOf`` was enforced only on ``type: integer`` by an integer (``{"type": "number",
  "multipleOf": 0.5}`` let 0.3 through);
- keywords beside ``$ref``, ``anyOf``, ``oneOf``, ``allOf``, ``enum`` or ``const`` were dropped
  (``{"$ref": ..., "minimum": 5}`` let 1 through), and a ``$ref`` other than a ``#/...`` pointer
  (an anchor, a remote document) matched any JSON; annotations beside them, and ``type`` beside an
  ``enum``/``const`` all of whose values have that type, are fine;
- a quote or backslash in a ``pattern`` or ``patternProperties`` key came out unescaped inside
  the JSON string (invalid JSON), and a property both in ``properties`` and matched by a
  ``patternProperties`` key got only its ``properties`` schema (found by review, 2026-12-06).

``format`` is enforced by grammars looser than ``jsonschema``'s format checker (``date`` takes
2023-02-31, ``ipv4`` leading zeros): accepted, as JSON Schema 2020-12 makes ``format`` an
annotation unless a validator opts into asserting it; llguidance checks month lengths.

The xgrammar backend refuses such a schema (INVALID_ARGUMENT naming the keyword and where it
stands) rather than produce output that breaks it; llguidance refuses most of these itself and
enforces the rest. ``oneOf`` is accepted and enforced as ``anyOf`` (at least one alternative
matches), which is exact for disjoint alternatives such as the tagged unions tools generate; where
alternatives overlap, a value matching two of them can come out (llguidance refuses ``oneOf``).
"""

from __future__ import annotations

import re
from typing import Any

#: Keywords whose presence (with a constraining value) xgrammar ignores.
UNENFORCED = ("not", "if", "then", "else", "contains", "minContains", "maxContains", "dependentRequired",
              "dependentSchemas", "dependencies")
#: Keywords whose value is one subschema.
_ONE_SCHEMA = ("additionalProperties", "items", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
               "additionalItems", "contentSchema")
#: Keywords whose value is a list of subschemas.
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
#: Keywords whose value maps names to subschemas (the names are not keywords).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def unenforced_use(schema: Any, where: str = "#") -> str | None:
    """The first use in ``schema`` of a keyword xgrammar does not enforce, as "'keyword' at
    path", or None. Only schema positions are walked: the values of ``const``, ``enum``,
    ``default`` or ``examples``, and property names, are data, not keywords."""
    if not isinstance(schema, dict):
        return None
    for keyword in UNENFORCED:
        if keyword in schema:
            return f"{keyword!r} at {where}"
    if schema.get("uniqueItems") is True:
        return f"'uniqueItems' at {where}"
    if "multipleOf" in schema and not (schema.get("type") == "integer" and _is_integer(schema["multipleOf"])):
        return f"'multipleOf' at {where} (enforced only on type 'integer', by an integer)"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"'allOf' of {len(schema['allOf'])} subschemas at {where} (xgrammar enforces one)"
    if found := _sibling_use(schema, where):
        return found
    if found := _pattern_use(schema, where):
        return found
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    if missing := [name for name in required if name not in properties]:
        return f"'required' name {missing[0]!r} missing from 'properties' at {where}"
    return _in_subschemas(schema, where)


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _in_subschemas(schema: dict[str, Any], where: str) -> str | None:
    children: list[tuple[Any, str]] = [(schema[key], f"{where}/{key}") for key in _ONE_SCHEMA if key in schema]
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            children += [(child, f"{where}/{key}/{i}") for i, child in enumerate(schema[key])]
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            children += [(child, f"{where}/{key}/{name}") for name, child in schema[key].items()]
    for child, path in children:
        if found := unenforced_use(child, path):
            return found
    return None


#: A quote or backslash written in a regex: literally, or as an escape of its code point.
_QUOTE_OR_BACKSLASH = re.compile(r'"|\\\\|\\x(22|5c)|\\u00(22|5c)', re.IGNORECASE)
#: A negated class (``[^"\\]``): it keeps quotes and backslashes out, which xgrammar gets right.
_NEGATED_CLASS = re.compile(r"\[\^(?:\\.|[^\]\\])*\]")


def _pattern_use(schema: dict[str, Any], where: str) -> str | None:
    """A ``pattern`` (or ``patternProperties`` key) matching a quote or backslash, which xgrammar
    writes unescaped into the JSON string; or a property named in ``properties`` that a
    ``patternProperties`` key also matches (xgrammar applies only the ``properties`` schema)."""
    pattern_properties = schema.get("patternProperties") if isinstance(schema.get("patternProperties"), dict) else {}
    patterns = [schema["pattern"]] if isinstance(schema.get("pattern"), str) else []
    for pattern in [*patterns, *pattern_properties]:
        if _QUOTE_OR_BACKSLASH.search(_NEGATED_CLASS.sub("", pattern)):
            return (f"a pattern with a literal quote or backslash at {where} ({pattern!r}: xgrammar writes it "
                    "unescaped into the JSON string)")
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    for pattern in pattern_properties:
        try:
            both = [name for name in properties if re.search(pattern, name)]
        except re.error:
            continue  # a pattern Python cannot read: the compile refuses it or judges it
        if both:
            return (f"property {both[0]!r} at {where} is also matched by 'patternProperties' key {pattern!r} "
                    "(xgrammar applies only its 'properties' schema)")
    return None


#: Keywords xgrammar converts alone, dropping the keywords beside them.
_ALONE = ("$ref", "anyOf", "oneOf", "allOf", "enum", "const")
#: Keywords that constrain a value (JSON Schema's validation and applicator vocabularies, and
#: ``format``, which xgrammar enforces). Anything else -- annotations, ``$defs``, vendor keys
#: such as ``x-order`` or OpenAPI's ``nullable`` and ``example`` -- constrains nothing beside them.
_CONSTRAINING = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "format", "maxItems", "minItems", "uniqueItems", "contains", "maxContains",
    "minContains", "maxProperties", "minProperties", "required", "dependentRequired", "dependentSchemas",
    "dependencies", "properties", "patternProperties", "additionalProperties", "propertyNames", "items",
    "prefixItems", "additionalItems", "unevaluatedItems", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "not",
    "if", "then", "else", "$ref", "$dynamicRef", "$recursiveRef"})
_JSON_TYPES = {"null": type(None), "boolean": bool, "object": dict, "array": list, "string": str}


def _of_type(value: Any, name: str) -> bool:
    if name == "integer":
        return _is_integer(value) or (isinstance(value, float) and value.is_integer())
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _JSON_TYPES.get(name, ()))


def _sibling_use(schema: dict[str, Any], where: str) -> str | None:
    """A keyword beside one xgrammar converts alone (``$ref``, a combinator, ``enum``, ``const``), or a
    ``$ref`` that is not a JSON pointer into this document (an anchor, a remote or ``$id``-relative one)."""
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        return f"'$ref' {ref!r} at {where} (only '#/...' pointers are resolved)"
    alone = [k for k in _ALONE if k in schema]
    if not alone:
        return None
    values = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    for key in schema:
        if key not in _CONSTRAINING or key == alone[0]:
            continue
        if key == "type" and values is not None and isinstance(values, list):
            types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
            if all(any(_of_type(v, t) for t in types) for v in values):
                continue
        return f"{key!r} beside {alone[0]!r} at {where} (xgrammar keeps only {alone[0]!r})"
    return None
