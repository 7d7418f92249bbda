"""Guided decoding (``GenerateRequest.guided``): the advertised modes are honoured (D4),
invalid specs are refused before acceptance (X1), grammar-complete outputs end with STOP
(G13), guided sampling is reproducible (G17, G18), and logprobs of guided tokens are finite
and of the masked distribution (L5, L6).

Every check skips unless ``generation.guided_decoding.supported`` is advertised; which
modes it exercises is what ``modes`` lists. The specs (``guides.py``) finish in a few
tokens, and requests run concurrently up to the server's ``max_running_requests``.

Backends: the contract only names ``guided.backend`` (empty = the engine's default). A
server may list its backends and each one's modes in ``ModelInfo.extra`` under
``refengine.guided_backends`` (``{"xgrammar": ["json_schema", ...], ...}``, refengine's
key); when it does, each backend is checked like the default one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf import json_format

from refengine.conformance.assertions import NON_OK, expect_finish, expect_rejected, expect_valid, is_finite
from refengine.conformance.checks_determinism import _join_all, _load_in_background
from refengine.conformance.guides import CASES, FIELD_MODES, WORDS_CASE, GuideCase
from refengine.conformance.registry import CheckFailed, check, expect, fail, not_claimed, skip
from refengine.conformance.streams import StreamResult
from refengine.conformance.target import Target
from refengine.protocol import oe

BACKENDS_KEY = "refengine.guided_backends"
UNKNOWN_BACKEND = "oeconf-no-such-backend"
TOKEN_IDS = oe.CANDIDATE_TOKEN_SELECTION_MODE_TOKEN_IDS
TOP_N = oe.CANDIDATE_TOKEN_SELECTION_MODE_TOP_N
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


@check("D4", "guided.backend set without a guide is refused before acceptance (ref)")
def guided_backend_without_guide(t: Target) -> str:
    """D4 (ref): a ``GuidedDecoding`` naming a backend but no guide is no advertised mode; it
    is refused before acceptance (ref: INVALID_ARGUMENT) rather than silently run unguided."""
    caps = t.caps.guided_decoding
    if not t.caps.HasField("guided_decoding") or not caps.HasField("supported"):
        not_claimed("guided decoding support is not reported")
    backends = list(listed_backends(t)) or ["xgrammar"]
    req = t.request("gd4n", max_tokens=2)
    req.guided.backend = backends[0]
    res = t.generate(req)
    expect_rejected(res, codes=NON_OK, what=f"guided.backend = {backends[0]!r} with no guide")
    return f"refused with {res.code.name}"


# -- X1: invalid specs are refused before acceptance -------------------------------------
@check("X1", "guided decoding: an invalid spec of each advertised mode is refused before acceptance")
def guided_invalid_spec_refused(t: Target) -> str:
    """X1: an invalid regex, a schema that is not JSON, an unbalanced grammar, an empty choice
    list, a structural tag that is not JSON: a non-OK status (ref: INVALID_ARGUMENT) and no
    event, never an accepted stream that fails later. Also with each listed backend."""
    modes = advertised_modes(t)
    backends = [""] + [name for name, listed in listed_backends(t).items() if listed]
    codes: set[str] = set()
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
            expect_rejected(res, codes=NON_OK, what=f"{case.name}: {case.invalid_what}{where}")
            codes.add(res.code.name)
            sent += 1
    if not sent:
        not_claimed("no advertised mode has an invalid spec to send (json_object only)")
    ref = "" if codes == {grpc.StatusCode.INVALID_ARGUMENT.name} else " (ref: INVALID_ARGUMENT)"
    return f"{sent} invalid specs refused before acceptance with {', '.join(sorted(codes))}{ref}"


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


# -- G17 / G18: reproducibility ------------------------------------------------------------
def _free_case(modes: set[int]) -> GuideCase:
    """A spec that leaves the model many tokens at each step: lowercase words, else any JSON."""
    if oe.GUIDED_DECODING_MODE_REGEX in modes:
        return WORDS_CASE
    for mode in (oe.GUIDED_DECODING_MODE_JSON_OBJECT, oe.GUIDED_DECODING_MODE_JSON_SCHEMA,
                 oe.GUIDED_DECODING_MODE_CHOICE):
        if mode in modes:
            return CASES[mode]
    not_claimed("none of json_object, json_schema, regex, choice is advertised")
    raise AssertionError  # unreachable: skip raises


def _alone_then_batched(t: Target, make: Any, tag: str) -> tuple[StreamResult, StreamResult, StreamResult]:
    """Run ``make()`` twice alone, then once while 3 unrelated requests run."""
    first, again = t.generate(make()), t.generate(make())
    background = _load_in_background(t, 3, tag)
    try:
        busy = t.generate(make())
    finally:
        _join_all(t, background)
    return first, again, busy


def _same_tokens(case: GuideCase, runs: tuple[StreamResult, ...], what: str) -> str:
    for i, res in enumerate(runs):
        problem = output_problem(case, res, f"{what}, run {i + 1}")
        expect(problem is None, problem or "")
    tokens = [res.tokens() for res in runs]
    expect(tokens[1] == tokens[0], f"{what}: alone twice, {tokens[0]} then {tokens[1]}")
    expect(tokens[2] == tokens[0], f"{what}: alone {tokens[0]} vs batched with 3 others {tokens[2]}")
    return f"{case.name}: {len(tokens[0])} tokens {runs[0].text()!r}, alone twice and batched"


@check("G17", "guided decoding: a seeded guided request gives the same tokens, alone and batched")
def guided_seed_reproducible(t: Target) -> str:
    """G17: seeded sampling under a grammar is reproducible, whatever else is batched."""
    case = _free_case(advertised_modes(t))
    runs = _alone_then_batched(
        t, lambda: guided_request(t, case, "g17g", temperature=1.0, seed=2024, max_tokens=16), "g17gbg")
    return _same_tokens(case, runs, f"seeded {case.name}")


@check("G18", "guided decoding: greedy guided output is independent of batch composition")
def guided_greedy_batch_invariant(t: Target) -> str:
    """G18: greedy output under a grammar does not depend on what else is batched (ref: identical)."""
    case = _free_case(advertised_modes(t))
    runs = _alone_then_batched(t, lambda: guided_request(t, case, "g18g", max_tokens=16), "g18gbg")
    return _same_tokens(case, runs, f"greedy {case.name}")


# -- L5 / L6: logprobs under a grammar -------------------------------------------------------
def _output_logprobs(t: Target) -> Any:
    caps = t.caps.output_logprobs
    if not t.caps.HasField("output_logprobs") or not caps.supported:
        not_claimed("output_logprobs not advertised as supported")
    return caps


def _with_logprobs(req: Any) -> Any:
    req.response.return_output_logprobs = True
    return req


@check("L5", "guided decoding: every sampled token carries a finite logprob and a rank (greedy: rank 1)")
def guided_logprobs_finite(t: Target) -> str:
    """L5 (with L6): a token the grammar allowed was drawn from the masked distribution, so
    its logprob is finite, and a greedy token is that distribution's most likely (rank 1)."""
    modes = advertised_modes(t)
    _output_logprobs(t)
    picked = [CASES[m] for m in CASES if m in modes and m != oe.GUIDED_DECODING_MODE_STRUCTURAL_TAG][:3]
    runs = []
    for i, case in enumerate(picked):
        runs.append((f"greedy {case.name}", case, True, _with_logprobs(guided_request(t, case, "gl5"))))
        runs.append((f"sampled {case.name}", case, False,
                     _with_logprobs(guided_request(t, case, "gl5s", temperature=1.0, seed=50 + i))))
    results = run_batch(t, [req for *_, req in runs])
    count = 0
    for (label, case, greedy, _), res in zip(runs, results, strict=True):
        problem = output_problem(case, res, label)
        expect(problem is None, problem or "")
        infos = res.token_infos()
        for j, info in enumerate(infos):
            lp = info.logprob if info.HasField("logprob") else None
            expect(lp is not None and is_finite(lp) and lp <= 1e-6,
                   f"{label}: token {j} ({info.token!r}) logprob {lp if lp is not None else 'absent'}")
            expect(info.HasField("rank") and info.rank >= 1, f"{label}: token {j} has no rank >= 1")
            expect(not greedy or info.rank == 1,
                   f"{label}: greedy token {j} ({info.token!r}) has rank {info.rank}; the greedy token is the most "
                   "likely of the (grammar-masked) distribution it was drawn from")
        count += len(infos)
    return f"{count} guided tokens over {len(runs)} requests: finite logprobs, greedy rank 1"


def _first_token(t: Target, req: Any, what: str) -> Any:
    res = t.generate(req)
    advertised_refusal(t.rule, res, what)
    infos = expect_valid(res, what=what).token_infos()
    expect(bool(infos), f"{what}: no token")
    return infos[0]


@check("L6", "guided decoding: logprobs are of the grammar-masked distribution (ref)")
def guided_logprobs_after_mask(t: Target) -> str:
    """L6 (ref: after grammar masking): a choice between "yes" and "no" leaves a few tokens;
    renormalized over them, the first token's logprob is above its unconstrained logprob for
    the same prompt (which the same request without the guide reports as a candidate)."""
    modes = advertised_modes(t)
    caps = _output_logprobs(t)
    if oe.GUIDED_DECODING_MODE_CHOICE not in modes:
        not_claimed("the choice mode is not advertised")
    if TOKEN_IDS not in caps.candidate_selection_modes:
        not_claimed("token_ids candidates are not advertised (needed to read the unconstrained logprob)")
    choice = CASES[oe.GUIDED_DECODING_MODE_CHOICE]
    guided = _first_token(t, _with_logprobs(guided_request(t, choice, "gl6", max_tokens=4)), "guided choice")
    plain = _with_logprobs(t.request("gl6u", max_tokens=1))
    plain.response.output_candidates.token_ids.ids.append(guided.token_id)
    first = _first_token(t, plain, "the same prompt without the guide")
    raw = [c.logprob for c in first.candidates if c.token_id == guided.token_id]
    expect(len(raw) == 1, f"token_ids candidate {guided.token_id} missing from {list(first.candidates)}")
    masked, unmasked = guided.logprob, raw[0]
    if unmasked > math.log(0.999):
        return f"inconclusive: token {guided.token!r} already has probability {math.exp(unmasked):.4f} unconstrained"
    if masked <= unmasked + 1e-3:
        fail(f"guided token {guided.token!r}: logprob {masked:.4f}, unconstrained {unmasked:.4f}; masked to the "
             "choices and renormalized it must be higher (ref: logprobs after grammar masking)")
    return f"token {guided.token!r}: {unmasked:.3f} unconstrained → {masked:.3f} under the grammar"
