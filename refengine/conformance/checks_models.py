"""Section D, model names (D8): ``model_id``, ``served_model_name`` and its aliases.

What a client can see: every name the server lists resolves (GetModelInfo) to the same
model and is accepted by Generate with the same greedy output; a name it does not
list (``model_id`` included, unless it is one of the names) is refused, because the
aliases list *every* other accepted name.
"""

from __future__ import annotations

from typing import Any

import grpc

from refengine.conformance.assertions import expect_rejected, expect_valid
from refengine.conformance.registry import check, expect, not_claimed
from refengine.conformance.target import Target
from refengine.protocol import oe

NOT_FOUND = (grpc.StatusCode.NOT_FOUND,)


def _info(t: Target, name: str) -> Any:
    code, info = t.unary_code("GetModelInfo", oe.GetModelInfoRequest(model=name))
    expect(code == grpc.StatusCode.OK, f"GetModelInfo({name!r}) returned {code.name}")
    return info


def _same_model(t: Target, info: Any, name: str) -> None:
    """Whatever name looked it up, ModelInfo names the same primary name and model_id."""
    m = t.model_info
    expect(info.served_model_name == m.served_model_name and info.model_id == m.model_id,
           f"GetModelInfo({name!r}) describes {info.served_model_name!r} (model_id {info.model_id!r}), not "
           f"{m.served_model_name!r} (model_id {m.model_id!r})")


def _greedy(t: Target, name: str) -> list[int]:
    req = t.request("d8", max_tokens=4)
    req.model = name
    return expect_valid(t.generate(req), what=f"Generate(model={name!r})").tokens()


@check("D8", "model_id set; served_model_name listed, resolves to itself and is accepted by Generate")
def primary_model_name(t: Target) -> str:
    """D8: ``model_id`` names the canonical source; ``served_model_name`` is the primary name."""
    m = t.model_info
    expect(bool(m.model_id), "ModelInfo.model_id is empty; it names the canonical model and tokenizer source")
    primary = m.served_model_name
    expect(bool(primary), "ModelInfo.served_model_name is empty; it is the primary name Generate accepts")
    listed = list(t.server_info.supported_models)
    expect(primary in listed, f"served_model_name {primary!r} is not in ServerInfo.supported_models {listed}")
    _same_model(t, _info(t, primary), primary)
    _greedy(t, primary)
    if m.model_id in (primary, *m.served_model_aliases):
        return f"{primary!r} accepted; model_id is one of the names"
    req = t.request("d8", max_tokens=1)
    req.model = m.model_id
    expect_rejected(t.generate(req), codes=NOT_FOUND,
                    what=f"model = model_id {m.model_id!r}, which is neither served_model_name nor an alias "
                    "(the aliases list every other accepted name)")
    return f"{primary!r} accepted; model_id {m.model_id!r} is not a name (NOT_FOUND)"


def _alias_shape(primary: str, aliases: list[str]) -> None:
    expect(all(aliases), f"served_model_aliases {aliases} has an empty name")
    expect(primary not in aliases, f"served_model_aliases {aliases} repeats the primary name {primary!r}; it "
                                   "lists the *other* accepted names")
    repeated = sorted({a for a in aliases if aliases.count(a) > 1})
    expect(not repeated, f"served_model_aliases lists {repeated} more than once")


@check("D8", "every served_model_aliases entry: distinct, accepted by GetModelInfo and Generate, same model")
def model_aliases(t: Target) -> str:
    """D8: each alias is another name of this model, not of another one: GetModelInfo(alias)
    describes it and Generate(model=alias) gives the primary name's greedy output."""
    primary, aliases = t.model_info.served_model_name, list(t.model_info.served_model_aliases)
    if not aliases:
        not_claimed("ModelInfo.served_model_aliases is empty: no alias to check")
    _alias_shape(primary, aliases)
    base = _greedy(t, primary)
    for alias in aliases:
        _same_model(t, _info(t, alias), alias)
        tokens = _greedy(t, alias)
        expect(tokens == base, f"greedy output with model={alias!r} {tokens} differs from model={primary!r} "
                               f"{base}: the alias does not serve the same model")
    return f"{len(aliases)} alias(es) {aliases} accepted, same model as {primary!r}"
