"""Structural tags (``guided.structural_tag``): xgrammar's JSON, in either of its forms.

- current: ``{"type": "structural_tag", "format": {...}}`` with any xgrammar format;
- legacy: ``{"type": "structural_tag", "structures": [{"begin", "schema", "end"}],
  "triggers": [...]}``: free text, in which each trigger starts one tagged segment whose
  content is JSON valid against the structure's schema.

The legacy form is the same as a current ``triggered_tags`` format whose tags have
JSON-schema contents; that common subset is what llguidance can express too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from refengine.sampling.guided.base import GuidedSpecError


@dataclass(frozen=True)
class TriggeredTag:
    trigger: str
    begin: str
    schema: dict[str, Any]
    end: str


def parse(spec: str) -> dict[str, Any]:
    try:
        tag = json.loads(spec)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the parser's stack
        raise GuidedSpecError(f"guided.structural_tag is not JSON: {exc}") from None
    if not isinstance(tag, dict) or tag.get("type") != "structural_tag":
        raise GuidedSpecError('guided.structural_tag must be a JSON object with "type": "structural_tag"')
    return tag


def legacy_to_current(tag: dict[str, Any]) -> dict[str, Any]:
    """The legacy form as a current ``triggered_tags`` format (xgrammar 0.2.9 takes only the latter)."""
    tags = [{"type": "tag", "begin": s.get("begin"), "content": {"type": "json_schema", "json_schema": s.get("schema")},
             "end": s.get("end")} for s in _objects(tag, "structures")]
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": _list(tag, "triggers"),
                                                 "tags": tags}}


def json_schemas(node: Any) -> list[Any]:
    """The schemas of every JSON-schema content in a current-form tag (``{"type": "json_schema",
    "json_schema": ...}`` at any depth of its format)."""
    if isinstance(node, list):
        return [schema for item in node for schema in json_schemas(item)]
    if not isinstance(node, dict):
        return []
    if node.get("type") == "json_schema" and "json_schema" in node:
        return [node["json_schema"]]
    return [schema for value in node.values() for schema in json_schemas(value)]


def triggered_tags(tag: dict[str, Any]) -> list[TriggeredTag]:
    """The tags of a legacy spec or of a current ``triggered_tags`` spec with JSON-schema
    contents; anything else raises ``GuidedSpecError`` (not expressible as triggered tags)."""
    if "format" not in tag:
        tag = legacy_to_current(tag)
    fmt = tag["format"]
    if not isinstance(fmt, dict) or fmt.get("type") != "triggered_tags" or fmt.get("at_least_one") or \
            fmt.get("stop_after_first") or fmt.get("excludes"):
        raise GuidedSpecError("this backend takes structural tags of the triggered_tags kind only (plain "
                              "triggers, JSON-schema contents); use the xgrammar backend for other formats")
    triggers = _list(fmt, "triggers")
    out = []
    for item in _objects(fmt, "tags"):
        begin, end, content = item.get("begin"), item.get("end"), item.get("content") or {}
        if not isinstance(begin, str) or not isinstance(end, str) or not isinstance(content, dict) \
                or content.get("type") != "json_schema":
            raise GuidedSpecError("structural tag: each tag needs a string begin and end and JSON-schema content")
        trigger = next((t for t in triggers if isinstance(t, str) and t and begin.startswith(t)), None)
        if trigger is None:
            raise GuidedSpecError(f"structural tag: begin {begin!r} starts with none of the triggers {triggers}")
        out.append(TriggeredTag(trigger, begin, content.get("json_schema") or {}, end))
    return out


def _list(obj: dict[str, Any], key: str) -> list[Any]:
    value = obj.get(key)
    if not isinstance(value, list) or not value:
        raise GuidedSpecError(f"structural tag: {key!r} must be a non-empty list")
    return value


def _objects(obj: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """``obj[key]``: a non-empty list of JSON objects."""
    value = _list(obj, key)
    if not all(isinstance(item, dict) for item in value):
        raise GuidedSpecError(f"structural tag: {key!r} must be a list of objects")
    return value
