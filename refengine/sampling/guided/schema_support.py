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
  "multipleOf": 0.5}`` let 0.3 through).

The xgrammar backend refuses such a schema (INVALID_ARGUMENT naming the keyword and where it
stands) rather than produce output that breaks it; llguidance refuses most of these itself and
enforces the rest. ``oneOf`` is accepted and enforced as ``anyOf`` (at least one alternative
matches), which is exact for disjoint alternatives such as the tagged unions tools generate; where
alternatives overlap, a value matching two of them can come out (llguidance refuses ``oneOf``).
"""

from __future__ import annotations

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
