"""Section L — prompt and output logprobs, ranks and candidates (L1–L6)."""

from __future__ import annotations

import math
from typing import Any

import grpc

from refengine.conformance.assertions import expect_rejected, expect_valid, is_finite
from refengine.conformance.registry import check, expect, not_claimed
from refengine.conformance.streams import StreamResult
from refengine.conformance.target import Target
from refengine.protocol import oe

TOP_N = oe.CANDIDATE_TOKEN_SELECTION_MODE_TOP_N
TOKEN_IDS = oe.CANDIDATE_TOKEN_SELECTION_MODE_TOKEN_IDS
ALL = oe.CANDIDATE_TOKEN_SELECTION_MODE_ALL


def _caps(t: Target, which: str) -> Any:
    """The LogprobCapabilities for 'prompt_logprobs' / 'output_logprobs'; skip when unsupported."""
    caps = getattr(t.caps, which)
    if not t.caps.HasField(which) or not caps.supported:
        not_claimed(f"{which} not advertised as supported")
    return caps


def _has_mode(t: Target, which: str, mode: int) -> bool:
    return t.caps.HasField(which) and mode in getattr(t.caps, which).candidate_selection_modes


def _lp_request(t: Target, tag: str, prompt_lp: bool = False, output_lp: bool = False, ids: list[int] | None = None,
                max_tokens: int = 4, **kw: Any) -> Any:
    req = t.request(tag, token_ids=ids, max_tokens=max_tokens, ignore_eos=True, **kw)
    if prompt_lp:
        req.response.return_prompt_logprobs = True
    if output_lp:
        req.response.return_output_logprobs = True
    return req


def _prompt(res: StreamResult) -> list[Any]:
    outs = res.of("prompt")
    expect(len(outs) == 1, f"expected one PromptOutput, got {len(outs)} ({res.kinds()})")
    return list(outs[0].tokens)


@check("L1", "PromptOutput at most once, only when requested, before any TokenOutput")
def prompt_output_once(t: Target) -> str:
    """L1: placement and multiplicity of PromptOutput; once per request also with several outputs
    (found by review: one PromptOutput per output passed), when num_sequences 2 is advertised."""
    res = expect_valid(t.generate(t.request("l1", max_tokens=2)))
    expect(not res.of("prompt"), f"PromptOutput sent without return_prompt_logprobs ({res.kinds()})")
    _caps(t, "prompt_logprobs")
    sequences = (1, 2) if t.max_num_sequences and t.max_num_sequences >= 2 else (1,)
    for num_sequences in sequences:
        for max_tokens in (4, 1):
            req = _lp_request(t, "l1", prompt_lp=True, ids=t.known_token_ids()[:5], max_tokens=max_tokens)
            if num_sequences > 1:
                req.sampling.num_sequences, req.sampling.temperature, req.sampling.seed = num_sequences, 1.0, 5
            kinds = expect_valid(t.generate(req), num_sequences=num_sequences).kinds()
            what = f"return_prompt_logprobs with max_tokens {max_tokens}, num_sequences {num_sequences}"
            expect(kinds.count("prompt") == 1, f"{what}: {kinds.count('prompt')} PromptOutput, expected 1 ({kinds})")
            if "token" in kinds:
                expect(kinds.index("prompt") < kinds.index("token"),
                       f"{what}: PromptOutput after a TokenOutput: {kinds}")
    return f"absent unless requested; once, first (max_tokens 4 and 1; num_sequences {sequences})"


@check("L2", "the first prompt token has no logprob/rank/candidates; prompt_logprob_start skips earlier positions")
def prompt_first_token(t: Target) -> str:
    """L2: position 0 is unconditioned; ``prompt_logprob_start`` (ref) skips positions."""
    caps = _caps(t, "prompt_logprobs")
    ids = t.known_token_ids()[:6]
    req = _lp_request(t, "l2", prompt_lp=True, ids=ids, max_tokens=1)
    if TOP_N in caps.candidate_selection_modes:
        req.response.prompt_candidates.top_n = 2
    tokens = _prompt(expect_valid(t.generate(req)))
    expect([x.token_id for x in tokens] == ids, f"prompt TokenInfo ids {[x.token_id for x in tokens]}, sent {ids}")
    first = tokens[0]
    expect(not first.HasField("logprob") and not first.HasField("rank") and not first.candidates,
           f"first prompt token carries logprob/rank/candidates: {first}")
    for i, info in enumerate(tokens[1:], 1):
        expect(info.HasField("logprob") and info.HasField("rank"), f"prompt position {i} has no logprob/rank")
    req = _lp_request(t, "l2s", prompt_lp=True, ids=ids, max_tokens=1)
    req.response.prompt_logprob_start = 3
    tokens = _prompt(expect_valid(t.generate(req)))
    expect([x.token_id for x in tokens] == ids[3:],
           f"prompt_logprob_start 3: positions {[x.token_id for x in tokens]}, expected {ids[3:]}")
    expect(all(x.HasField("logprob") for x in tokens), "positions after prompt_logprob_start lack logprobs")
    note = _prompt_position_matches_output(t, ids[:5])
    return "position 0 bare; start=3 reports positions 3.." + note


def _prompt_position_matches_output(t: Target, ids: list[int]) -> str:
    """L2/L3 alignment: the greedy token x after ``ids``, sent back as the prompt's last token,
    has there the output's logprob and rank 1: position i's data is of token i given tokens
    < i (found by review: prompt logprobs rotated by one position passed every L check)."""
    if not t.caps.HasField("output_logprobs") or not t.caps.output_logprobs.supported:
        return ""
    out = expect_valid(t.generate(_lp_request(t, "l2o", output_lp=True, ids=ids, max_tokens=1))).token_infos()
    expect(len(out) == 1 and out[0].HasField("logprob"), f"one greedy output token with a logprob expected: {out}")
    x = out[0]
    tokens = _prompt(expect_valid(t.generate(_lp_request(t, "l2x", prompt_lp=True, ids=[*ids, x.token_id],
                                                         max_tokens=1))))
    last = tokens[-1]
    expect(last.token_id == x.token_id and last.HasField("logprob") and abs(last.logprob - x.logprob) <= 0.05,
           f"greedy token {x.token_id} after {ids} has output logprob {x.logprob:.4f}; as the prompt's last token "
           f"its logprob is {last.logprob if last.HasField('logprob') else 'absent'}: prompt positions carry "
           "another position's data")
    expect(not last.HasField("rank") or last.rank == 1 or abs(last.logprob - x.logprob) <= RANK_TIE_LOGPROB,
           f"greedy token {x.token_id} has rank {last.rank} as the prompt's last token, expected 1")
    return f"; the last prompt position matches the greedy output ({x.logprob:.4f})"


@check("L3", "one TokenInfo per token with id, text, logprob, rank and candidates together")
def token_info_aligned(t: Target) -> str:
    """L3: logprob data is attached to its token, never in a parallel list."""
    caps = _caps(t, "output_logprobs")
    req = _lp_request(t, "l3", output_lp=True, max_tokens=5)
    if TOP_N in caps.candidate_selection_modes:
        req.response.output_candidates.top_n = 2
    res = expect_valid(t.generate(req))
    infos = res.token_infos()
    usage = res.usage()  # None: no usage at all is G16's finding; the count is then the tokens asked for
    completion = usage.completion_tokens if usage is not None else req.stopping.max_tokens
    expect(len(infos) == completion, f"{len(infos)} TokenInfo for {completion} completion tokens")
    for i, info in enumerate(infos):
        expect(info.HasField("logprob") and info.HasField("rank"), f"output token {i} lacks logprob or rank")
        expect(info.token != "" or info.token_id == 0, f"output token {i} ({info.token_id}) has no text")
        if TOP_N in caps.candidate_selection_modes:
            expect(0 < len(info.candidates) <= 2, f"output token {i} has {len(info.candidates)} candidates, top_n 2")
            _expect_own_candidate(info, 2, f"output token {i}")
        _expect_candidate_texts(info.candidates, f"output token {i}")
    return f"{len(infos)} aligned TokenInfo" + _prompt_texts(t)


def _expect_own_candidate(info: Any, top_n: int, where: str) -> None:
    """L3 "together": the token's own entry among its top_n candidates (when its rank is within
    them, or it is listed) has its logprob and text (ranks agreeing is L5's). Found by review: the
    logprob, rank and candidates of another position attached to this token (a parallel list off
    by one) passed every L check."""
    mine = [c for c in info.candidates if c.token_id == info.token_id]
    if not mine:
        tied = info.candidates and abs(info.candidates[-1].logprob - info.logprob) <= RANK_TIE_LOGPROB
        expect(not info.HasField("rank") or info.rank > top_n or tied,
               f"{where}: token {info.token_id} has rank {info.rank} but is not among its top_n {top_n} candidates "
               f"{[c.token_id for c in info.candidates]}: its logprob data belongs to another position")
        return
    c = mine[0]
    expect(not info.HasField("logprob") or abs(c.logprob - info.logprob) <= 1e-4,
           f"{where}: token {info.token_id} logprob {info.logprob}, its candidate entry {c.logprob}")
    expect(not c.token or c.token == info.token,
           f"{where}: token {info.token_id} has text {info.token!r}, its candidate entry {c.token!r}")


def _expect_candidate_texts(candidates: Any, where: str) -> None:
    for c in candidates:
        expect(c.token != "" or c.token_id == 0, f"{where}: candidate {c.token_id} has no text")


def _prompt_texts(t: Target) -> str:
    """L3 on the prompt (found by review: only output tokens were read; an engine may leave the
    text out of prompt TokenInfos and candidates by default): each position and candidate has
    its text. "" when prompt logprobs are not advertised."""
    if not t.caps.HasField("prompt_logprobs") or not t.caps.prompt_logprobs.supported:
        return ""
    req = _lp_request(t, "l3p", prompt_lp=True, ids=t.known_token_ids()[:6], max_tokens=1)
    if _has_mode(t, "prompt_logprobs", TOP_N):
        req.response.prompt_candidates.top_n = 2
    tokens = _prompt(expect_valid(t.generate(req)))
    for i, info in enumerate(tokens):
        expect(info.token != "" or info.token_id == 0, f"prompt position {i} ({info.token_id}) has no text")
        if i and _has_mode(t, "prompt_logprobs", TOP_N):
            _expect_own_candidate(info, 2, f"prompt position {i}")
        _expect_candidate_texts(info.candidates, f"prompt position {i}")
    return f"; {len(tokens)} prompt positions with their text"


def _check_ranked(cands: Any, where: str) -> None:
    ranks = [c.rank for c in cands if c.HasField("rank")]
    lps = [c.logprob for c in cands]
    expect(all(lps[i] >= lps[i + 1] - 1e-6 for i in range(len(lps) - 1)), f"{where}: logprobs not ordered {lps}")
    if ranks:
        expect(ranks == sorted(ranks) and ranks[0] == 1, f"{where}: ranks {ranks} not ascending from 1")


RANK_TIE_LOGPROB = 1e-6  # logprobs this close may be ranked either way


def _check_top(cands: Any, where: str) -> None:
    """top_n candidates are the most likely tokens, none left out: each one's rank is one more
    than the number of candidates above it (ties, within RANK_TIE_LOGPROB, either way), so the
    ranks run 1, 2, 3 (or 1, 1, 3 for a tie); 1, 3 means rank 2 was left out. Ids are distinct."""
    ids = [c.token_id for c in cands]
    expect(len(set(ids)) == len(ids), f"{where}: repeated candidate ids {ids}")
    for c in cands:
        if not c.HasField("rank"):
            continue
        above = sum(other.logprob > c.logprob + RANK_TIE_LOGPROB for other in cands)
        above_or_tied = sum(other.logprob > c.logprob - RANK_TIE_LOGPROB for other in cands if other is not c)
        expect(above + 1 <= c.rank <= above_or_tied + 1,
               f"{where}: token {c.token_id} has rank {c.rank}, but {above} candidates are above it: the top "
               f"candidates are not all there (ranks {[x.rank for x in cands]})")


def _top_n_where_the_token_is_not_first(t: Target) -> None:
    """L4 where the token itself may rank below N (found by review: vLLM's ``logprobs=k`` gives
    k + 1 entries then, and greedy runs never show it): sampled output tokens (T=1) and prompt
    positions carry at most N candidates, the top N."""
    sampled = _lp_request(t, "l4ns", output_lp=True, max_tokens=8, temperature=1.0)
    sampled.sampling.seed = 77
    sampled.response.output_candidates.top_n = 3
    for i, info in enumerate(expect_valid(t.generate(sampled)).token_infos()):
        expect(0 < len(info.candidates) <= 3, f"top_n 3, sampled (T=1): token {i} (rank {info.rank}) has "
                                              f"{len(info.candidates)} candidates")
        _check_top(info.candidates, f"top_n 3, sampled: token {i}")
    if not _has_mode(t, "prompt_logprobs", TOP_N) or not t.caps.prompt_logprobs.supported:
        return
    req = _lp_request(t, "l4np", prompt_lp=True, ids=t.known_token_ids()[:8], max_tokens=1)
    req.response.prompt_candidates.top_n = 2
    for i, info in enumerate(_prompt(expect_valid(t.generate(req)))[1:], 1):
        expect(0 < len(info.candidates) <= 2, f"prompt top_n 2: position {i} has {len(info.candidates)} candidates "
                                          f"(ranks {[c.rank for c in info.candidates]})")


@check("L4", "candidates: top_n ≤ N by rank, token_ids exactly those ids, all = whole vocabulary")
def candidate_modes(t: Target) -> str:
    """L4: each advertised CandidateTokenSelection mode; unadvertised modes and top_n above
    max_top_n are refused (D4)."""
    caps = _caps(t, "output_logprobs")
    modes = set(caps.candidate_selection_modes)
    done = []
    if TOP_N in modes:
        req = _lp_request(t, "l4n", output_lp=True, max_tokens=3)
        req.response.output_candidates.top_n = 3
        for i, info in enumerate(expect_valid(t.generate(req)).token_infos()):
            expect(0 < len(info.candidates) <= 3, f"top_n 3: token {i} has {len(info.candidates)} candidates")
            _check_ranked(info.candidates, f"top_n token {i}")
            _check_top(info.candidates, f"top_n 3: token {i}")
        _top_n_where_the_token_is_not_first(t)
        if caps.HasField("max_top_n"):
            req = _lp_request(t, "l4m", output_lp=True, max_tokens=1)
            req.response.output_candidates.top_n = caps.max_top_n + 1
            expect_rejected(t.generate(req), what=f"top_n = max_top_n + 1 = {caps.max_top_n + 1}")
        done.append("top_n")
    wanted = sorted(set(t.known_token_ids()[:3]))
    req = _lp_request(t, "l4i", output_lp=True, max_tokens=2)
    req.response.output_candidates.token_ids.ids.extend(wanted)
    if TOKEN_IDS in modes:
        for i, info in enumerate(expect_valid(t.generate(req)).token_infos()):
            got = sorted(c.token_id for c in info.candidates)
            expect(got == wanted, f"token_ids {wanted}: token {i} has candidates {got}")
        done.append("token_ids")
    else:
        expect_rejected(t.generate(req), codes=(grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED,
                                                grpc.StatusCode.FAILED_PRECONDITION), what="unadvertised token_ids")
    req = _lp_request(t, "l4a", output_lp=True, max_tokens=2, temperature=1.0)
    req.sampling.seed = 1
    req.response.output_candidates.all.SetInParent()
    if ALL in modes:
        infos = expect_valid(t.generate(req)).token_infos()
        sizes = {len(info.candidates) for info in infos}
        expect(len(sizes) == 1, f"all: candidate counts differ between positions {sizes}")
        size = sizes.pop()
        top = max(t.known_token_ids())
        expect(size > top, f"all: {size} candidates, but token id {top} exists")
        ids = [c.token_id for c in infos[0].candidates]
        expect(len(set(ids)) == len(ids), "all: repeated candidate ids")
        mass = math.fsum(math.exp(c.logprob) for c in infos[0].candidates)
        expect(abs(mass - 1.0) < 1e-3, f"all: candidate probabilities sum to {mass}, expected 1")
        done.append(f"all ({size})")
    else:
        expect_rejected(t.generate(req), codes=(grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED,
                                                grpc.StatusCode.FAILED_PRECONDITION), what="unadvertised all")
    return "modes checked: " + ", ".join(done)


@check("L5", "every sampled token carries a finite logprob and a 1-based rank; greedy tokens have rank 1")
def logprob_and_rank(t: Target) -> str:
    """L5: logprob/rank of generated tokens (ref: ranks are 1-based, as vLLM)."""
    caps = _caps(t, "output_logprobs")
    greedy = expect_valid(t.generate(_lp_request(t, "l5g", output_lp=True, max_tokens=6)))
    for i, info in enumerate(greedy.token_infos()):
        expect(info.HasField("logprob") and is_finite(info.logprob) and info.logprob <= 1e-6,
               f"greedy token {i}: logprob {info.logprob if info.HasField('logprob') else 'absent'}")
        expect(info.HasField("rank") and info.rank == 1, f"greedy token {i}: rank "
                                                         f"{info.rank if info.HasField('rank') else 'absent'}, "
                                                         "expected 1 (ref: ranks are 1-based, as vLLM)")
    req = _lp_request(t, "l5s", output_lp=True, max_tokens=8, temperature=1.0)
    req.sampling.seed = 77
    if TOP_N in caps.candidate_selection_modes:
        req.response.output_candidates.top_n = 5
    for i, info in enumerate(expect_valid(t.generate(req)).token_infos()):
        expect(info.HasField("logprob") and is_finite(info.logprob) and info.logprob <= 1e-6,
               f"sampled token {i}: logprob {info.logprob}")
        expect(info.HasField("rank") and info.rank >= 1,
               f"sampled token {i}: rank {info.rank} (ref: ranks are 1-based)")
        for c in info.candidates:
            if c.token_id == info.token_id:
                expect(abs(c.logprob - info.logprob) < 1e-4,
                       f"token {i}: logprob {info.logprob} but its candidate entry says {c.logprob}")
                if c.HasField("rank"):
                    expect(c.rank == info.rank, f"token {i}: rank {info.rank}, candidate rank {c.rank}")
    return "greedy rank 1; sampled ranks >= 1 and consistent with candidates"


@check("L6", "logprobs are of the distribution sampled from (ref: after temperature)")
def logprobs_after_temperature(t: Target) -> str:
    """L6: at temperature T, log p_T(a) - log p_T(b) = (log p_1(a) - log p_1(b)) / T."""
    caps = _caps(t, "output_logprobs")
    if TOP_N not in caps.candidate_selection_modes:
        not_claimed("top_n candidates not advertised (needed to compare distributions)")

    def first_position(temperature: float) -> dict[int, float]:
        req = _lp_request(t, "l6", output_lp=True, max_tokens=1, temperature=temperature)
        req.sampling.seed = 3
        req.response.output_candidates.top_n = 4
        infos = expect_valid(t.generate(req)).token_infos()
        return {c.token_id: c.logprob for c in infos[0].candidates}

    base, hot = first_position(1.0), first_position(0.5)
    common = [tid for tid in base if tid in hot]
    expect(len(common) >= 2, f"top-4 candidates at T=1 {list(base)} and T=0.5 {list(hot)} share < 2 ids")
    a = common[0]
    for b in common[1:]:
        want = (base[a] - base[b]) / 0.5
        got = hot[a] - hot[b]
        expect(abs(got - want) <= 1e-3 * max(1.0, abs(want)),
               f"T=0.5 log-ratio of tokens {a}/{b} is {got:.5f}; the tempered distribution gives {want:.5f} "
               f"(T=1 gives {base[a] - base[b]:.5f})")
    return f"log-ratios scale by 1/T over {len(common)} candidates"
