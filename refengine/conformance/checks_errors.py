"""Section X — error reporting (X1–X4), including the run-wide X4 look at every enum
value the server sent: X is the last section, so that check sees the whole run."""

from __future__ import annotations

import re
import time
from typing import Any

import grpc
from google.protobuf import json_format

from refengine.conformance.assertions import (
    NON_OK,
    expect_rejected,
    skip_if_cut_short,
    skip_if_done_before_deadline,
    stream_violations,
)
from refengine.conformance.enums import enum_name, value_name
from refengine.conformance.registry import check, expect, fail, skip
from refengine.conformance.release import PRE_RELEASE_VALUES, RELEASE
from refengine.conformance.streams import StreamResult
from refengine.conformance.target import Target
from refengine.protocol import oe

#: X3: always retryable — the unchanged request can succeed once the load falls. (The release has no
#: DRAINING code; a drain cut-off is CANCELLED, see :func:`retryable_problem`.) KV_TRANSFER_FAILED is in
#: neither set: a broken transfer path may recover (retryable), a released session never comes back
#: (not retryable, as K8 asks); only the check that caused the failure knows which (found by review:
#: it was always-retryable here, contradicting K8).
RETRYABLE = {oe.ERROR_CODE_OVERLOADED}
NEVER_RETRYABLE = {oe.ERROR_CODE_INVALID_ARGUMENT, oe.ERROR_CODE_UNSUPPORTED_FEATURE, oe.ERROR_CODE_ROLE_MISMATCH,
                   oe.ERROR_CODE_MODEL_NOT_FOUND, oe.ERROR_CODE_DUPLICATE_REQUEST}


def _invalid_requests(t: Target) -> list[tuple[str, object, str]]:
    """(what, request, the rule that says it must be refused): X1 owns how a refusal looks (a
    non-OK status, no event); whether a request must be refused at all is that rule's."""
    no_input = t.request("x1")
    no_input.ClearField("input")
    bad_temp = t.request("x1")
    bad_temp.sampling.temperature = -1.0
    bad_model = t.request("x1")
    bad_model.model = "oeconf-no-such-model"
    bad_token = t.request("x1", token_ids=[0xFFFFFFFF])
    return [("no input", no_input, "G1"), ("temperature -1", bad_temp, "G5"), ("unknown model", bad_model, "G3"),
            ("token id 2^32-1", bad_token, "X1")]


@check("X1", "before acceptance: non-OK status and zero events; an accepted stream never fails by status")
def error_before_and_after_acceptance(t: Target) -> str:
    """X1: refusals carry no events; accepted streams (normal, aborted) end OK with their
    terminal event, an EngineError (if any) being the last event. An invalid request that is
    accepted and ends OK was not refused at all: that is the finding of the rule that says it
    must be (G1, G3, G5), noted here; a refusal after events is X1's. An out-of-vocabulary
    token id, which no rule says must be refused before acceptance, may instead fail after it:
    then the stream is judged as X1 says an accepted one must end."""
    accepted: list[str] = []
    late: list[str] = []
    invalid = _invalid_requests(t)
    for what, req, owner in invalid:
        res = t.generate(req)
        if res.ok and owner != "X1":
            accepted.append(f"{what} ({owner} fails for it)")
            continue
        if res.ok:
            # No rule says an out-of-vocabulary token id must be refused before acceptance: an
            # engine may find it only when it runs the request, and then X1 asks for exactly one
            # terminal EngineError and OK (judged here), not a refusal.
            problems = stream_violations(res)
            expect(not problems, f"{what}, accepted: " + "; ".join(problems[:3]))
            late.append(f"{what} ({'EngineError after acceptance' if res.of('error') else 'accepted'})")
            continue
        expect_rejected(res, codes=NON_OK, what=what)
    streams: list[StreamResult] = [t.generate(t.request("x1ok", max_tokens=3))]
    req = t.long_request("x1ab")
    streams.append(t.generate_aborted(req))
    for res in streams:
        expect(res.ok, f"an accepted stream ended with status {res.code.name}: {res.describe()}")
        problems = stream_violations(res)
        expect(not problems, "; ".join(problems))
    t.wait_idle("X1")
    errors = sum(len(s.of("error")) for s in streams)
    note = f"; accepted: {', '.join(accepted + late)}" if accepted or late else ""
    return (f"{len(invalid) - len(accepted) - len(late)} refusals with zero events; normal and aborted streams "
            f"end OK ({errors} EngineError seen){note}")


@check("X1", "transport failure (client deadline): non-OK status, no synthesized EngineError")
def transport_failure(t: Target) -> str:
    """X1: a deadline that expires is a DEADLINE_EXCEEDED status, never an EngineError event."""
    req = t.long_request("x1dl", cap=4000)
    res = t.generate(req, timeout=0.4)
    skip_if_cut_short(res, "a long request before its deadline")
    skip_if_done_before_deadline(res, 0.4, f"a {req.stopping.max_tokens}-token request")
    expect(res.code == grpc.StatusCode.DEADLINE_EXCEEDED, f"0.4 s deadline: {res.describe()}")
    expect(not res.of("error"), "an EngineError event was synthesized for a transport failure")
    t.wait_idle("X1 deadline")
    return f"DEADLINE_EXCEEDED after {len(res.events)} event(s)"


def stalled_stream(t: Target) -> StreamResult:
    """A long stream whose reader stalls ``options.slow_reader_s`` seconds after its first
    event: a server with a stall timeout below that gives up on it after acceptance."""
    wait = t.options.slow_reader_s
    req = t.long_request("x1slow", cap=4000)
    if t.options.slow_reader_extra:
        json_format.ParseDict(t.options.slow_reader_extra, req.extra)
    caps = t.caps.output_logprobs
    if t.caps.HasField("output_logprobs") and caps.supported:  # big events fill the transport window sooner
        if oe.CANDIDATE_TOKEN_SELECTION_MODE_ALL in caps.candidate_selection_modes:
            req.response.return_output_logprobs = True
            req.response.output_candidates.all.SetInParent()
        elif caps.HasField("max_top_n"):
            req.response.return_output_logprobs = True
            req.response.output_candidates.top_n = caps.max_top_n
    res = StreamResult(request_id=req.request_id, rule=t.rule)
    with t.fixed_window_inference() as inference:
        call = inference.Generate(req, timeout=t.options.stream_timeout_s + wait)
        try:
            first = next(call, None)  # None: an OK stream without events (G12's finding, not a crash here)
            if first is not None:
                res.events.append(first)
                time.sleep(wait)
                res.events.extend(call)
            res.code, res.details = call.code(), call.details() or ""
        except grpc.RpcError as err:
            res.code, res.details = err.code(), err.details() or ""
        finally:
            t.abort(req.request_id)
    for event in res.events:  # read outside Target.generate: record it for X3/X4 by hand
        t.observe(event)
    t.cache.setdefault("x3_streams", []).append(res)
    return res


@check("X1", "a failure after acceptance (stalled reader) is one terminal EngineError, then OK")
def error_after_acceptance(t: Target) -> str:
    """X1: provoke a post-acceptance failure by not reading a stream for
    ``options.slow_reader_s`` seconds (longer than the server's stall timeout): if the
    server gives up on the stream it must end it with exactly one EngineError, status OK."""
    wait = t.options.slow_reader_s
    if wait <= 0:
        skip("no post-acceptance failure provoked (set slow_reader_s above the server's stall timeout)")
    res = stalled_stream(t)
    if res.ok and not res.events:
        skip("the stalled stream ended OK without any event (G12 fails for it): nothing stalled")
    errors = res.of("error")
    if not errors and res.code == grpc.StatusCode.DEADLINE_EXCEEDED:  # the client's own deadline: no finding
        skip(f"the stalled stream outlived this client's {t.options.stream_timeout_s + wait:.0f} s deadline "
             f"after {len(res.events)} events: no stall failure was provoked (raise stream_timeout_s)")
    if not errors:
        expect(res.ok, f"a stalled stream ended with {res.describe()[:300]} (not OK, no EngineError)")
        t.wait_idle("X1 slow reader")
        return f"the server buffered the whole stream through a {wait:.0f} s stall (no failure provoked)"
    problems = stream_violations(res)
    expect(len(errors) == 1, f"{len(errors)} EngineError events in one stream")
    expect(not problems, "; ".join(problems[:3]))
    t.wait_idle("X1 slow reader")
    err = errors[0]
    return (f"{len(res.events)} events, then EngineError {enum_name(oe.ErrorCode, err.code)} "
            f"retryable={err.retryable}, OK")


@check("X2", "unary RPCs report failures with a non-OK status only")
def unary_failures(t: Target) -> str:
    """X2: failing Control calls raise a gRPC status, not an OK response hiding the failure (an
    empty response). An OK answer that says something (a ModelInfo, an AbortResponse with a
    status, a loaded adapter) treats the call as no failure at all: whether it is one, and with
    which status, is the rule defining the call's answers (D3, A1, A2, R1/R4/R5, E6)."""
    calls = [
        ("GetModelInfo(unknown)", "GetModelInfo", oe.GetModelInfoRequest(model="oeconf-no-such-model")),
        ("Abort()", "Abort", oe.AbortRequest()),
        ("Abort(unknown)", "Abort", oe.AbortRequest(request_id="oeconf-never-sent")),
        ("UnloadLora(unknown)", "UnloadLora", oe.UnloadLoraRequest(lora_name="oeconf-no-such-adapter")),
        ("LoadLora(id 0)", "LoadLora", oe.LoadLoraRequest(adapter=oe.LoraAdapter(lora_id=0, lora_name=""))),
        ("GetKvEventSources(dup ranks)", "GetKvEventSources", oe.GetKvEventSourcesRequest(data_parallel_ranks=[0, 0])),
    ]
    seen = []
    for what, method, request in calls:
        code, resp = t.unary_code(method, request)
        expect(code != grpc.StatusCode.OK or resp.ByteSize() > 0,
               f"{what} answered OK with an empty {type(resp).__name__}; a failure must be a non-OK status")
        seen.append(f"{what}={code.name}" if code != grpc.StatusCode.OK else f"{what}=OK with an answer (not X2's)")
    return ", ".join(seen)


def _names_drain(message: str) -> bool:
    """The message names a drain: the word (drain, drains, draining, drained), not a part of one."""
    return re.search(r"\bdrain(s|ing|ed)?\b", message, re.IGNORECASE) is not None


def retryable_problem(err: Any) -> str | None:
    """X3: why ``err.retryable`` (or its code) is wrong for this EngineError; None when fine.

    Retryable: OVERLOADED always; CANCELLED when a drain cut the stream off (ref: its message
    names the drain; the suite cannot drain a server, so it reads the message). KV_TRANSFER_FAILED
    either way (see RETRYABLE). The release has no DRAINING code."""
    code = value_name(oe.ErrorCode.DESCRIPTOR, err.code)
    if err.code not in oe.ErrorCode.values():
        hint = PRE_RELEASE_VALUES.get(("openengine.v1.ErrorCode", err.code), "not a value of the release")
        return f"EngineError code {err.code} ({err.message!r}): {hint}; {RELEASE} has no DRAINING code"
    if err.code in RETRYABLE and not err.retryable:
        return f"{code} with retryable = false ({err.message!r}); the unchanged request can succeed later"
    if err.code in NEVER_RETRYABLE and err.retryable:
        return f"{code} with retryable = true ({err.message!r}); the unchanged request fails again"
    if _names_drain(err.message):
        # INTERNAL naming a drain is the pre-release DRAINING (11) only when it says a retry may
        # succeed: an internal failure that merely mentions a drain ("... while draining its
        # output queue", not retryable) is an INTERNAL error (found by review: it was flagged).
        if err.code == oe.ERROR_CODE_INTERNAL and err.retryable:
            return (f"a drain cut-off sent as {code} ({err.message!r}); 11 was DRAINING only in the pre-release "
                    "copy: the release ends it with CANCELLED, retryable = true")
        if err.code == oe.ERROR_CODE_CANCELLED and not err.retryable:
            return f"a drain cut-off ({err.message!r}) is CANCELLED with retryable = true (ref), got false"
    return None


@check("X3", "EngineError.retryable is true only for failures the unchanged request could survive")
def retryable_truthful(t: Target) -> str:
    """X3: checked on every EngineError the run saw (any check's streams); none = SKIP."""
    errors = list(t.engine_errors)
    if not errors:
        skip("no EngineError could be provoked from a client (needs overload, a KV transfer failure or a drain "
             "cut-off; set slow_reader_s above the server's stall timeout)")
    problems = [p for p in map(retryable_problem, errors) if p]
    expect(not problems, "; ".join(problems[:3]))
    kinds = sorted({f"{enum_name(oe.ErrorCode, e.code)} retryable={e.retryable}" for e in errors})
    return f"{len(errors)} EngineError(s) checked: {', '.join(kinds)}"


@check("X4", "unknown enum values are read as UNSPECIFIED, never an error")
def unknown_enums(t: Target) -> str:
    """X4: a HealthRequest.role the server does not know acts like UNSPECIFIED (its own role)."""
    code, resp = t.unary_code("Health", oe.HealthRequest(role=97))
    expect(code == grpc.StatusCode.OK, f"Health(role=97) returned {code.name}; an unknown enum value must read as "
                                       "UNSPECIFIED")
    base = t.unary("Health", oe.HealthRequest())
    expect(resp.state == base.state, f"Health(role=97) state {resp.state} != Health() state {base.state}")
    if t.model_info.HasField("supports_multimodal") and t.model_info.supports_multimodal:
        return "Health(role=97) fine; unknown Modality not sent (needs a media item)"
    return "Health(role=97) reads as UNSPECIFIED"


def _gather_enum_samples(t: Target) -> None:
    """Make sure the run saw every kind of enum a client gets, whatever was selected:
    Health (with probe), discovery, load, a finished and an aborted stream, both Abort
    outcomes, and (when the options allow) an EngineError."""
    t.unary("Health", oe.HealthRequest())
    t.unary("Health", oe.HealthRequest(include_inference_probe=True))
    t.unary("GetServerInfo", oe.GetServerInfoRequest())
    t.unary("GetModelInfo", oe.GetModelInfoRequest(model=t.model))
    if t.has_load:  # optional RPC
        t.load(per_rank=True)
    done = t.request("x4", max_tokens=2)
    t.generate(done)
    t.unary_code("Abort", oe.AbortRequest(request_id=done.request_id))  # ALREADY_FINISHED
    long = t.long_request("x4ab")
    t.generate_aborted(long)  # ABORTED, FinishReason CANCELLED
    if not t.engine_errors and t.options.slow_reader_s > 0:
        stalled_stream(t)
    t.wait_idle("X4 samples")


def _unknown_value(enum: Any, value: int, where: str) -> str:
    hint = PRE_RELEASE_VALUES.get((enum.full_name, value), "")
    return f"{enum.name} {value} at {where}" + (f" ({hint})" if hint else "")


@check("X4", "every enum value the server sends is a value of the release (HealthState ≤ 4, ErrorCode ≤ 11, ...)")
def release_enum_values(t: Target) -> str:
    """X4 (sender side): a client reads an unknown value as UNSPECIFIED, so a server that
    sends one (e.g. the pre-release HealthState 5 or ErrorCode 12) loses its meaning.
    Looks at every enum value this run received (Health states, EngineError codes,
    finish reasons, capability modes, ...) plus samples of its own."""
    _gather_enum_samples(t)
    unknown = t.enums.unknown()
    if unknown:
        fail(f"values outside {RELEASE} sent: " + "; ".join(_unknown_value(*u) for u in unknown[:6]))
    errors = "" if t.enums.values("openengine.v1.ErrorCode") else " (no EngineError seen: ErrorCode not sampled)"
    return f"all values known: {t.enums.summary()}{errors}"
