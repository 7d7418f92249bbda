"""Guided decoding's outputs under sampling: a seeded or greedy guided request gives the same
tokens alone and batched (G17, G18), and logprobs of guided tokens are finite and of the
grammar-masked distribution (L5, L6). The requests and helpers are ``checks_guided``'s.
"""

from __future__ import annotations

import math
from typing import Any

from refengine.conformance.assertions import expect_valid, is_finite
from refengine.conformance.checks_determinism import _join_all, _load_in_background
from refengine.conformance.checks_guided import (
    TOKEN_IDS,
    advertised_modes,
    advertised_refusal,
    guided_request,
    output_problem,
    run_batch,
)
from refengine.conformance.guides import CASES, WORDS_CASE, GuideCase
from refengine.conformance.registry import check, expect, fail, not_claimed
from refengine.conformance.streams import StreamResult
from refengine.conformance.target import Target
from refengine.protocol import oe


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
        _join_all(background)
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
