"""Section G, part 1 — what Generate accepts and refuses before acceptance (G1–G8)."""

from __future__ import annotations

import math

import grpc
from google.protobuf import json_format

from refengine.conformance.assertions import expect_finish, expect_rejected, expect_valid
from refengine.conformance.enums import enum_name
from refengine.conformance.registry import check, expect, not_claimed
from refengine.conformance.target import Target
from refengine.protocol import oe

ALREADY_EXISTS = (grpc.StatusCode.ALREADY_EXISTS,)
NOT_FOUND = (grpc.StatusCode.NOT_FOUND,)


@check("G1", "exactly one input: none → INVALID_ARGUMENT with zero events; prompt or token_ids accepted")
def one_input(t: Target) -> str:
    """G1: the input oneof must be set."""
    req = t.request("g1")
    req.ClearField("input")
    expect_rejected(t.generate(req), what="request without prompt or token_ids")
    if t.supports_text():
        expect_valid(t.generate(t.request("g1", prompt="Hello", max_tokens=2)), what="prompt input")
    if not (t.model_info.HasField("supports_token_ids_input") and not t.model_info.supports_token_ids_input):
        expect_valid(t.generate(t.request("g1", token_ids=t.known_token_ids()[:3], max_tokens=2)),
                     what="token_ids input")
    return "no input refused; each single input accepted"


@check("G2", "request_id: empty refused; duplicate of an active request → ALREADY_EXISTS; reusable after end")
def request_id_rules(t: Target) -> str:
    """G2: request ids are non-empty and unique among active requests."""
    req = t.request("g2", max_tokens=2)
    req.request_id = ""
    expect_rejected(t.generate(req), what="empty request_id")

    long = t.long_request("g2")
    running, accepted = t.start_stream(long)
    try:
        expect(accepted, "the first request was not seen accepted (no event, no GetLoad count)")
        dup = oe.GenerateRequest()
        dup.CopyFrom(long)
        dup.stopping.max_tokens = 2
        expect_rejected(t.generate(dup), codes=ALREADY_EXISTS, what="duplicate of an active request_id")
    finally:
        t.abort(long.request_id)
    first = running.join()
    expect(first.ok, f"the original stream was disturbed by the duplicate: {first.describe()}")
    again = oe.GenerateRequest()
    again.CopyFrom(long)
    again.stopping.max_tokens = 2
    expect_valid(t.generate(again), what="request_id reused after its stream ended (aborted)")
    # ... and after one that finished on its own (found by review: only reuse after an abort was tried)
    expect_valid(t.generate(again), what="request_id reused after its stream finished (LENGTH)")
    return "empty refused, duplicate ALREADY_EXISTS, reuse after an abort and after a finish accepted"


@check("G3", "model: empty = default (ref), the served name accepted, unknown → NOT_FOUND")
def model_selection(t: Target) -> str:
    """G3: the model must be served (that every alias is accepted too is D8's: model_aliases)."""
    req = t.request("g3", max_tokens=1)
    req.model = "oeconf-no-such-model"
    expect_rejected(t.generate(req), codes=NOT_FOUND, what="unknown model")
    name = t.model_info.served_model_name
    req = t.request("g3", max_tokens=1)
    req.model = name
    expect_valid(t.generate(req), what=f"model {name!r}")
    req = t.request("g3", max_tokens=1)
    req.model = ""
    res = t.generate(req)
    expect_valid(res, what="empty model (ref: the default model)")
    return f"{name!r} accepted, unknown NOT_FOUND, empty = default"


@check("G4", "num_sequences: omitted = 1, 0 → INVALID_ARGUMENT, above max → INVALID_ARGUMENT")
def num_sequences(t: Target) -> str:
    """G4: num_sequences defaults to 1 and is range-checked."""
    res = expect_valid(t.generate(t.request("g4", max_tokens=2)), what="num_sequences omitted")
    indices = {f.output_index for f in res.of("finished")} | {e.output_index for e in res.of("token")}
    expect(indices == {0}, f"num_sequences omitted produced outputs {sorted(indices)}, expected [0]")
    req = t.request("g4", max_tokens=2)
    req.sampling.num_sequences = 0
    expect_rejected(t.generate(req), what="num_sequences = 0")
    if t.max_num_sequences is None:
        return "omitted = 1, 0 refused; max_num_sequences not advertised"
    req = t.request("g4", max_tokens=2)
    req.sampling.num_sequences = t.max_num_sequences + 1
    expect_rejected(t.generate(req), what=f"num_sequences = max_num_sequences + 1 = {t.max_num_sequences + 1}")
    return f"omitted = 1, 0 and {t.max_num_sequences + 1} refused"


BAD_SAMPLING = [
    ("temperature", -0.5), ("temperature", math.nan),
    ("top_p", 0.0), ("top_p", -0.1), ("top_p", 1.5), ("top_p", math.nan),
    ("top_k", -2),
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", math.nan),
    ("frequency_penalty", math.inf), ("frequency_penalty", math.nan),
    ("presence_penalty", -math.inf), ("presence_penalty", math.nan),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.nan),
    ("repetition_penalty", math.inf),
]
GOOD_SAMPLING = [
    ("temperature", 0.0), ("top_p", 1.0), ("top_k", 0), ("top_k", -1), ("top_k", 5),
    ("min_p", 0.0), ("min_p", 1.0), ("frequency_penalty", -2.0), ("presence_penalty", 2.0),
    ("repetition_penalty", 1.3),
]


@check("G5", "every sampling value is range-checked before acceptance")
def sampling_ranges(t: Target) -> str:
    """G5: out-of-range or non-finite sampling values are INVALID_ARGUMENT with zero events."""
    for name, value in BAD_SAMPLING:
        req = t.request("g5", max_tokens=1)
        setattr(req.sampling, name, value)
        expect_rejected(t.generate(req), what=f"sampling.{name} = {value}")
    for name, value in GOOD_SAMPLING:
        req = t.request("g5", max_tokens=1, temperature=None)
        setattr(req.sampling, name, value)
        req.sampling.seed = 7
        expect_valid(t.generate(req), what=f"in-range sampling.{name} = {value}")
    return f"{len(BAD_SAMPLING)} out-of-range values refused, {len(GOOD_SAMPLING)} boundary values accepted"


@check("G6", "empty StopCondition → INVALID_ARGUMENT; min_tokens > max_tokens → INVALID_ARGUMENT")
def stop_condition_shape(t: Target) -> str:
    """G6: every stop condition sets one kind; min_tokens <= max_tokens."""
    req = t.request("g6", max_tokens=2)
    req.stopping.conditions.add()
    expect_rejected(t.generate(req), what="empty StopCondition")
    req = t.request("g6", max_tokens=2)
    req.stopping.conditions.add(stop_text="zzz")
    req.stopping.conditions.add()
    expect_rejected(t.generate(req), what="an empty StopCondition next to a valid one")
    req = t.request("g6", max_tokens=3, min_tokens=4)
    expect_rejected(t.generate(req), what="min_tokens 4 > max_tokens 3")
    req = t.request("g6", max_tokens=3, min_tokens=3)
    res = expect_valid(t.generate(req), what="min_tokens = max_tokens = 3")
    expect(len(res.tokens()) == 3, f"min_tokens = max_tokens = 3 produced {len(res.tokens())} tokens")
    return "empty conditions and min > max refused"


@check("G7", "context limit: prompt or prompt + max_tokens beyond it → INVALID_ARGUMENT before acceptance")
def context_limit(t: Target) -> str:
    """G7: requests that cannot fit the context are refused; max_tokens unset = up to the limit (ref)."""
    ctx = t.max_context_length
    if ctx is None:
        not_claimed("max_context_length is not advertised")
    ids = t.known_token_ids()
    long_ids = (ids * (ctx // len(ids) + 2))[: ctx + 1]
    expect_rejected(t.generate(t.request("g7", token_ids=long_ids, max_tokens=1)),
                    what=f"prompt of {ctx + 1} tokens > max_context_length {ctx}")
    short = ids[:4]
    expect_rejected(t.generate(t.request("g7", token_ids=short, max_tokens=ctx - 3)),
                    what=f"4-token prompt + max_tokens {ctx - 3} > {ctx}")
    # Exactly at the limit: accepted (then aborted at once, nothing runs long).
    fits = t.request("g7", token_ids=short, max_tokens=ctx - 4)
    res = t.generate(fits, on_event=lambda r, e, c: True)
    expect(bool(res.events), f"4-token prompt + max_tokens {ctx - 4} = {ctx} was refused: {res.describe()}")
    t.abort(fits.request_id)
    if ctx - 3 > t.options.max_long_prompt:
        t.wait_idle("G7")
        return f"limit {ctx} enforced; filling the context skipped (> {t.options.max_long_prompt} tokens)"
    near = t.request("g7", token_ids=(ids * (ctx // len(ids) + 2))[: ctx - 3], max_tokens=None,
                     ignore_eos=True)
    res = expect_valid(t.generate(near, timeout=max(t.options.stream_timeout_s, 120)),
                       what=f"prompt of {ctx - 3} tokens, max_tokens unset")
    fin = expect_finish(res, oe.FINISH_REASON_LENGTH, what="output ended by the context limit")
    expect(len(res.tokens()) <= 3, f"{len(res.tokens())} tokens generated past a {ctx - 3}-token prompt, "
                                   f"context {ctx}")
    t.wait_idle("G7")
    return f"limit {ctx} enforced; max_tokens unset stopped at the limit ({enum_name(oe.FinishReason, fin.reason)})"


#: G8: a value of the wrong JSON type for each type name a known ``extra`` key may have.
WRONG_EXTRA_VALUE = {"number": "not-a-number", "string": 12345, "bool": "yes", "list": 1, "struct": 1}
#: The JSON Schema spellings of those type names, which an engine may well advertise instead.
EXTRA_KIND_ALIASES = {"integer": "number", "boolean": "bool", "array": "list", "object": "struct"}


@check("G8", "extra: empty valid, unknown keys ignored, known key with wrong type → INVALID_ARGUMENT")
def extra_struct(t: Target) -> str:
    """G8: ``extra`` never breaks a portable request.

    Known keys are taken from ``ModelInfo.extra["generate_extra_keys"]`` (a struct of
    key -> JSON type name) when the server advertises them, else from the run's
    ``Options.known_extra_keys``."""
    base = expect_valid(t.generate(t.request("g8", max_tokens=6)), what="empty extra")
    req = t.request("g8", max_tokens=6)
    json_format.ParseDict({"oeconf_unknown": 1, "oeconf_nested": {"a": [1, "b", None]}}, req.extra)
    res = expect_valid(t.generate(req), what="unknown extra keys")
    expect(res.tokens() == base.tokens(), "unknown extra keys changed the greedy output "
                                          f"{base.tokens()} -> {res.tokens()}")
    model_extra = json_format.MessageToDict(t.model_info.extra)
    known = model_extra.get("generate_extra_keys") or t.options.known_extra_keys
    if not isinstance(known, dict) or not known:
        return ("empty and unknown keys fine; no known extra keys advertised (ModelInfo.extra.generate_extra_keys)"
                " or given (known_extra_keys)")
    checked, unknown_kinds = 0, []
    for key, kind in known.items():
        value = WRONG_EXTRA_VALUE.get(EXTRA_KIND_ALIASES.get(kind, kind)) if isinstance(kind, str) else None
        if value is None:  # a type name the suite cannot probe: said in the note, never counted as checked
            unknown_kinds.append(f"{key}: {kind!r}")
            continue
        req = t.request("g8", max_tokens=2)
        json_format.ParseDict({key: value}, req.extra)
        expect_rejected(t.generate(req), what=f"extra.{key} (a {kind}) set to {value!r}")
        checked += 1
    note = f"; not type-checked (unknown type names): {', '.join(unknown_kinds)}" if unknown_kinds else ""
    return f"{checked} of {len(known)} known keys type-checked{note}"
