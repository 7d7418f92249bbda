"""Guided decoding (``GenerateRequest.guided``): the advertised modes are honoured (D4),
invalid specs are refused before acceptance (X1), grammar-complete outputs end with STOP
(G13). Reproducibility (G17, G18) and logprobs (L5, L6) under a grammar: ``checks_guided_sampling``.

Every check skips unless ``generation.guided_decoding.supported`` is advertised; which
modes it exercises is what ``modes`` lists. The specs (``guides.py``) finish in a few
tokens, and requests run concurrently up to the server's ``max_running_requests``, at most
``MAX_WIDTH`` (8).

Backends: the contract only names ``guided.backend`` (empty = the engine's default). A
server may list its backends and each one's modes in ``ModelInfo.extra`` under
``refengine.guided_backends`` (``{"xgrammar": ["json_schema", ...], ...}``, refengine's
key); when it does, each backend is checked like the default one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf import json_format

from refengine.conformance.assertions import NON_OK, expect_finish, expect_rejected, expect_valid
from refengine.conformance.enums import enum_name
from refengine.conformance.guides import CASES, FIELD_MODES, GuideCase
from refengine.conformance.registry import CheckFailed, check, expect, not_claimed, skip
from refengine.conformance.streams import StreamResult
from refengine.conformance.target import Target
from refengine.protocol import oe

BACKENDS_KEY = "refengine.guided_backends"
UNKNOWN_BACKEND = "oeconf-no-such-backend"
TOKEN_IDS = oe.CANDIDATE_TOKEN_SELECTION_MODE_TOKEN_IDS
MAX_WIDTH = 8  # most requests a check keeps in flight at once


# -- discovery -------------------------------------------------------------------------
def advertised_modes(t: Target) -> set[int]:
    """The advertised guided modes; skip when guided decoding is not advertised."""
    caps = t.caps.guided_decoding
    if not t.caps.HasField("guided_decoding") or not caps.HasField("supported"):
        not_claimed("guided decoding support is not reported")
    if not caps.supported:
        not_claimed("guided decoding is not supported (generation.guided_decoding.supported = false)")
    modes = set(caps.modes) & set(CASES)
    if not modes:
        not_claimed("guided decoding is supported but no mode is advertised")
    return modes


def listed_backends(t: Target) -> dict[str, set[int]]:
    """``ModelInfo.extra["refengine.guided_backends"]``: backend -> its modes; {} when absent."""
    listed = json_format.MessageToDict(t.model_info.extra).get(BACKENDS_KEY)
    if not isinstance(listed, dict):
        return {}
    return {name: {FIELD_MODES[m] for m in modes if m in FIELD_MODES}
            for name, modes in listed.items() if isinstance(modes, list)}


# -- requests ----------------------------------------------------------------------------
def guided_request(t: Target, case: GuideCase, tag: str, backend: str = "", temperature: float = 0.0,
                   seed: int | None = None, max_tokens: int | None = None) -> Any:
    req = t.request(tag, max_tokens=max_tokens or case.max_tokens, temperature=temperature)
    case.fill(req.guided)
    if backend:
        req.guided.backend = backend
    if seed is not None:
        req.sampling.seed = seed
    return req


def width(t: Target) -> int:
    cap = t.server_info.capacity
    running = cap.max_running_requests if cap.HasField("max_running_requests") else 4
    return max(1, min(running, MAX_WIDTH))


def run_batch(t: Target, requests: Iterable[Any]) -> list[StreamResult]:
    """Every request, ``width(t)`` at a time, results in order."""
    requests, results = list(requests), []
    step = width(t)
    for i in range(0, len(requests), step):
        calls = [t.generate_async(r) for r in requests[i: i + step]]
        results.extend(call.join() for call in calls)
    return results


def advertised_refusal(rule: str, res: StreamResult, what: str) -> None:
    """An advertised mode refused before acceptance is D4's finding; a check of another rule has
    no output to judge then (skip)."""
    if rule != "D4" and not res.ok and not res.events:
        skip(f"{what}: an advertised guided mode was refused before acceptance ({res.code.name}: {res.details!r}); "
             "D4 fails for it")


def output_problem(case: GuideCase, res: StreamResult, what: str) -> str | None:
    """Why ``res`` is not an accepted stream whose output follows ``case``; None when it is."""
    advertised_refusal(res.rule, res, what)
    try:
        expect_valid(res, what=what)
    except CheckFailed as exc:
        return str(exc)
    fin = res.finished()
    complete = fin is not None and fin.reason == oe.FINISH_REASON_STOP
    problem = case.verify(res.text(), complete)
    return f"{what}: output {res.text()!r} {problem}" if problem else None


def honoured(t: Target, cases: list[tuple[str, GuideCase, Any]]) -> tuple[dict[str, StreamResult], list[str]]:
    """Run (label, case, request) triples concurrently; returns results by label and problems."""
    results = run_batch(t, [req for _, _, req in cases])
    problems = [p for (label, case, _), res in zip(cases, results, strict=True)
                if (p := output_problem(case, res, label)) is not None]
    return {label: res for (label, _, _), res in zip(cases, results, strict=True)}, problems


def _summary(results: dict[str, StreamResult]) -> str:
    return "; ".join(f"{label} → {res.text()!r}" for label, res in results.items())


# -- D4: every advertised mode is honoured ------------------------------------------------
@check("D4", "guided decoding: every advertised mode is accepted and the output follows its spec")
def guided_modes_honoured(t: Target) -> str:
    """D4: an advertised mode is accepted, and the output follows the constraint (greedy,
    small specs; a JSON output cut off by max_tokens must be a prefix of a valid one).
    The results are kept for G13."""
    modes = advertised_modes(t)
    cases = [(CASES[m].name, CASES[m], guided_request(t, CASES[m], "gd4")) for m in CASES if m in modes]
    results, problems = honoured(t, cases)
    t.cache["guided_results"] = results  # by mode name
    expect(not problems, "; ".join(problems[:4]))
    t.wait_idle("after guided requests")
    return _summary(results)


@check("D4", "guided decoding: each listed backend honours its modes; a backend not listed is refused")
def guided_backends_honoured(t: Target) -> str:
    """D4: with ``ModelInfo.extra["refengine.guided_backends"]`` listing backends, each
    honours every mode it lists and refuses the others before acceptance, and a backend
    name not listed is refused before acceptance."""
    advertised_modes(t)
    backends = listed_backends(t)
    if not backends:
        not_claimed(f"no backend list in ModelInfo.extra[{BACKENDS_KEY!r}] (the contract advertises no backends)")
    cases, refused = [], []
    for name, modes in backends.items():
        for mode, case in CASES.items():
            if mode in modes:
                cases.append((f"{name}/{case.name}", case, guided_request(t, case, "gd4b", backend=name)))
            else:
                refused.append((f"{name}/{case.name} (not listed)", guided_request(t, case, "gd4b", backend=name)))
    regex = CASES[oe.GUIDED_DECODING_MODE_REGEX]
    refused.append((f"backend {UNKNOWN_BACKEND!r}", guided_request(t, regex, "gd4b", backend=UNKNOWN_BACKEND)))
    results, problems = honoured(t, cases)
    expect(not problems, "; ".join(problems[:4]))
    for what, req in refused:
        expect_rejected(t.generate(req), codes=NON_OK, what=what)
    return f"{len(cases)} backend/mode pairs honoured, {len(refused)} refused ({', '.join(backends)})"


@check("D4", "guided.backend set without a guide: refused before acceptance (ref), or run unconstrained")
def guided_backend_without_guide(t: Target) -> str:
    """D4: a ``GuidedDecoding`` naming a backend but no guide is no advertised mode. refengine
    refuses it before acceptance (ref: INVALID_ARGUMENT); RULES D4 does not say so, and a server
    reading it as no constraint conforms too (found by review: that failed D4). Either way it is
    refused before acceptance or it runs to a valid output, never accepted and then failed."""
    caps = t.caps.guided_decoding
    if not t.caps.HasField("guided_decoding") or not caps.HasField("supported"):
        not_claimed("guided decoding support is not reported")
    backends = list(listed_backends(t)) or ["xgrammar"]
    req = t.request("gd4n", max_tokens=2)
    req.guided.backend = backends[0]
    res = t.generate(req)
    what = f"guided.backend = {backends[0]!r} with no guide"
    if res.ok:
        expect_valid(res, what=f"{what}, accepted")
        return "accepted and run without a constraint (ref: refused before acceptance, INVALID_ARGUMENT)"
    expect_rejected(res, codes=NON_OK, what=what)
    return f"refused before acceptance with {res.code.name}" + \
        ("" if res.code == grpc.StatusCode.INVALID_ARGUMENT else " (ref: INVALID_ARGUMENT)")


# -- X1: invalid specs are refused, in the form of the phase the engine finds them in ------
def spec_refusal(res: StreamResult, what: str) -> str:
    """How an invalid spec was refused, as X1 has it for either phase (found by review: only a
    refusal before acceptance passed, though an engine compiling grammars after accepting the
    request may report it then): a non-OK status and no event, or, after acceptance, exactly one
    EngineError and OK (no output comes before it: there is none without the guide). X3 judges
    the error's ``retryable``."""
    if res.ok and res.of("error"):
        expect(res.kinds() == ["error"], f"{what}: accepted, then {res.kinds()}: refused after acceptance, the "
                                         "stream is exactly one EngineError, then OK")
        return f"after acceptance, EngineError {enum_name(oe.ErrorCode, res.of('error')[0].code)}"
    expect(not res.ok, f"{what}: accepted and not refused ({res.describe()}): want a non-OK status before "
                       "acceptance, or one EngineError after it")
    expect_rejected(res, codes=NON_OK, what=what)
    return f"before acceptance, {res.code.name}"


@check("X1", "guided decoding: an invalid spec of each advertised mode is refused (status, or one EngineError)")
def guided_invalid_spec_refused(t: Target) -> str:
    """X1: an invalid regex, a schema that is not JSON, an unbalanced grammar, an empty choice
    list, a structural tag that is not JSON: refused, never run unguided. Before acceptance a
    non-OK status (ref: INVALID_ARGUMENT) and no event; after acceptance one EngineError, then
    OK (:func:`spec_refusal`). Also with each listed backend."""
    modes = advertised_modes(t)
    backends = [""] + [name for name, listed in listed_backends(t).items() if listed]
    forms: set[str] = set()
    sent = 0
    for backend in backends:
        for mode, case in CASES.items():
            if mode not in modes or case.invalid is None:
                continue
            req = t.request("gx1", max_tokens=4)
            case.invalid(req.guided)
            if backend:
                req.guided.backend = backend
            res = t.generate(req)
            where = f" (backend {backend})" if backend else ""
            forms.add(spec_refusal(res, f"{case.name}: {case.invalid_what}{where}"))
            sent += 1
    if not sent:
        not_claimed("no advertised mode has an invalid spec to send (json_object only)")
    ref = "" if forms == {f"before acceptance, {grpc.StatusCode.INVALID_ARGUMENT.name}"} else \
        " (ref: before acceptance, INVALID_ARGUMENT)"
    return f"{sent} invalid specs refused: {'; '.join(sorted(forms))}{ref}"


# -- G13: a completed grammar ends the output with STOP -----------------------------------
@check("G13", "guided decoding: an output whose grammar completed ends with STOP naming the stop token")
def guided_finish_stop(t: Target) -> str:
    """G13: regex, choice and EBNF specs admit only a few characters; once the grammar is
    complete only a stop token may follow, so the output ends with reason STOP and a
    ``stop_match`` (the EOS token), within max_tokens."""
    modes = advertised_modes(t)
    finite = [CASES[m] for m in CASES if m in modes and CASES[m].finite]
    if not finite:
        not_claimed("no advertised mode with a bounded output (regex, choice, ebnf_grammar)")
    cached = t.cache.get("guided_results") or {}
    missing = [c for c in finite if c.name not in cached]
    if missing:
        fresh, _ = honoured(t, [(c.name, c, guided_request(t, c, "g13g")) for c in missing])
        cached = {**cached, **fresh}
    for case in finite:
        res = cached[case.name]
        advertised_refusal(t.rule, res, case.name)  # cached from D4: judged by this check's rule
        expect_valid(res, what=case.name)
        fin = expect_finish(res, oe.FINISH_REASON_STOP,
                            what=f"{case.name}: output {res.text()!r} (the grammar was complete: it ends with STOP)")
        expect(fin.HasField("stop_match") and fin.stop_match.WhichOneof("match") is not None,
               f"{case.name}: STOP without stop_match")
    return f"{len(finite)} modes ended STOP ({', '.join(c.name for c in finite)})"
