"""Section G, part 3 — stop handling and usage (G14–G16)."""

from __future__ import annotations

from refengine.conformance.assertions import expect_finish, expect_valid, usage_violations
from refengine.conformance.checks_output import (
    eos_reference,
    first_unique_token,
    greedy_reference,
    some_stop,
    spanning_stop,
    text_through,
)
from refengine.conformance.enums import enum_name
from refengine.conformance.registry import check, expect, skip
from refengine.conformance.streams import StreamResult
from refengine.conformance.target import Target
from refengine.protocol import oe


def _stop_run(t: Target, stop_text: str | None = None, stop_token: int | None = None,
              include: bool | None = None, max_tokens: int = 24) -> StreamResult:
    req = t.request("g14", max_tokens=max_tokens, ignore_eos=True)
    if stop_text is not None:
        req.stopping.conditions.add(stop_text=stop_text)
    if stop_token is not None:
        req.stopping.conditions.add(stop_token_id=stop_token)
    if include is not None:
        req.stopping.include_stop_in_output = include
    return expect_valid(t.generate(req), what=f"stop {stop_text!r}" if stop_text else f"stop token {stop_token}")


def _supports_include(t: Target) -> bool:
    return t.caps.HasField("supports_stop_in_output") and t.caps.supports_stop_in_output


@check("G14", "a stop string spanning deltas stays out of text (held back), also across 3 deltas")
def stop_string_held_back(t: Target) -> str:
    """G14: include_stop_in_output = false removes the matched stop string even when the
    match starts in one delta and ends in a later one."""
    ref = greedy_reference(t)
    full = ref.text()
    notes = []
    for span in (1, 2):
        stop, start, needed = spanning_stop(ref, span)
        res = _stop_run(t, stop_text=stop)
        expect_finish(res, oe.FINISH_REASON_STOP, what=f"stop {stop!r}")
        expect(res.text() == full[:start],
               f"stop {stop!r} across {span + 1} deltas: text {res.text()!r}, expected {full[:start]!r}")
        expect(stop not in res.text(), f"matched stop {stop!r} leaked into the text {res.text()!r}")
        toks = res.tokens()
        expect(toks == ref.tokens()[: len(toks)] and len(toks) <= needed,
               f"stop {stop!r}: tokens {toks} are not a prefix of the reference {ref.tokens()[:needed]} "
               f"ending by the match (at most {needed} tokens)")
        notes.append(f"{stop!r}")
        if _supports_include(t):
            res = _stop_run(t, stop_text=stop, include=True)
            expect(res.text() == full[: start + len(stop)],
                   f"include_stop_in_output: text {res.text()!r}, expected {full[: start + len(stop)]!r}")
    return f"stops {', '.join(notes)} held back" + (" (include=true checked)" if _supports_include(t) else "")


@check("G14", "text held back for a partial stop match is released when the match fails")
def partial_match_released(t: Target) -> str:
    """G14: holding back must not lose text: a stop string whose prefix matches at a delta
    boundary but never completes leaves the full text intact; so does one whose prefix is the
    output's last characters, held back when the LENGTH finish comes (found by review: only the
    first was asked, so a server dropping what it held back at a LENGTH finish passed)."""
    ref = greedy_reference(t)
    tail = ref.text()[-2:]
    stops = [some_stop(ref) + "\u2603\u2603"] + ([tail + "\u2603\u2603"] if tail else [])  # never produced
    for never in stops:
        res = _stop_run(t, stop_text=never)
        expect_finish(res, oe.FINISH_REASON_LENGTH, what=f"never-matching stop {never!r}")
        expect(res.text() == ref.text(), f"with the partially matching stop {never!r} the text is {res.text()!r}, "
                                         f"expected the full {ref.text()!r}")
        expect(res.tokens() == ref.tokens(), f"the partially matching stop {never!r} changed the tokens")
    return "full text released at finish, also with the output's tail held back"


@check("G14", "a matched stop token is kept out of tokens and text (include false), kept when true")
def stop_token_excluded(t: Target) -> str:
    """G14: include_stop_in_output for caller stop tokens."""
    ref = greedy_reference(t)
    j, token = first_unique_token(ref)
    res = _stop_run(t, stop_token=token)
    expect_finish(res, oe.FINISH_REASON_STOP, what=f"stop token {token}")
    expect(res.tokens() == ref.tokens()[:j], f"stop token {token} at position {j}: tokens {res.tokens()}, "
                                             f"expected {ref.tokens()[:j]}")
    # A prefix only where no invalid byte run is rendered: a byte-fallback tokenizer gives one U+FFFD
    # per byte of a run, and the run cut short may decode to a character (found by review).
    whole = "\ufffd" not in ref.text()
    expect(not whole or ref.text().startswith(res.text()), f"text {res.text()!r} is not a prefix of {ref.text()!r}")
    # Exact when a delta ends right before token j and no character can be split there: the
    # reference is ASCII (then every token has text of its own), or a delta also ends right
    # before token j - 1 and token j - 1 has text (it completes no character with token j).
    earlier, before, through = text_through(ref, j - 1), text_through(ref, j), text_through(ref, j + 1)
    ascii_text = ref.text().isascii()
    exact = before is not None and (ascii_text or (earlier is not None and earlier != before))
    if exact:
        expect(res.text() == before, f"stop token {token} excluded: text {res.text()!r}, expected {before!r}")
    if _supports_include(t):
        res = _stop_run(t, stop_token=token, include=True)
        expect(res.tokens() == ref.tokens()[: j + 1],
               f"include_stop_in_output: tokens {res.tokens()}, expected {ref.tokens()[: j + 1]}")
        expect(not whole or ref.text().startswith(res.text()),
               f"include_stop_in_output: text {res.text()!r} is not a prefix of {ref.text()!r}")
        if exact and through is not None:
            expect(res.text() == through, f"include_stop_in_output: text {res.text()!r}, expected {through!r}")
        elif exact and ascii_text:
            expect(len(res.text()) > len(before), f"include_stop_in_output: text {res.text()!r} lacks the stop "
                                                  f"token's own text after {before!r}")
    return f"stop token {token} at position {j}" + ("" if exact else " (its text not delimited: prefix only)")


@check("G15", "min_tokens suppresses stop tokens until reached")
def min_tokens_stop_token(t: Target) -> str:
    """G15: a stop token that would end the output at position j < min_tokens is suppressed."""
    ref = greedy_reference(t)
    j, token = first_unique_token(ref)
    req = t.request("g15", max_tokens=j + 6, min_tokens=j + 3, ignore_eos=True)
    req.stopping.conditions.add(stop_token_id=token)
    res = expect_valid(t.generate(req))
    toks = res.tokens()
    expect(toks[:j] == ref.tokens()[:j], f"tokens before the suppressed stop differ: {toks[:j]} vs "
                                         f"{ref.tokens()[:j]}")
    expect(len(toks) >= j + 3, f"min_tokens {j + 3}: output ended after {len(toks)} tokens "
                               f"({enum_name(oe.FinishReason, res.finished().reason)})")
    return f"stop token at position {j} suppressed until min_tokens {j + 3}"


@check("G15", "min_tokens suppresses EOS; ignore_eos never stops at EOS")
def min_tokens_eos(t: Target) -> str:
    """G15: EOS is suppressed below min_tokens, and ignored entirely with ignore_eos."""
    found = eos_reference(t)
    if found is None:
        skip("no prompt reached EOS within 48 tokens: EOS suppression cannot be observed")
    base_req, base = found
    if base.finished().stop_match.WhichOneof("match") != "eos_token_id":
        skip("the EOS stop's stop_match does not name eos_token_id (G13 fails for it)")
    eos_id = base.finished().stop_match.eos_token_id
    k = len([x for x in base.tokens() if x != eos_id])
    req = t.request("g15e", prompt=base_req.prompt, max_tokens=k + 4, min_tokens=k + 2)
    res = expect_valid(t.generate(req))
    n = len([x for x in res.tokens() if x != eos_id])
    expect(n >= k + 2, f"min_tokens {k + 2}: output ended after {n} tokens ({res.finished()})")
    req = t.request("g15i", prompt=base_req.prompt, max_tokens=k + 3, ignore_eos=True)
    res = expect_valid(t.generate(req))
    fin = expect_finish(res, oe.FINISH_REASON_LENGTH, what="ignore_eos past the natural EOS")
    expect(fin.stop_match.WhichOneof("match") != "eos_token_id", "ignore_eos output stopped at EOS")
    expect(len(res.tokens()) == k + 3, f"ignore_eos, max_tokens {k + 3}: {len(res.tokens())} tokens")
    return f"EOS {eos_id} after {k} tokens suppressed by min_tokens and ignore_eos"


@check("G16", "usage only on the final response; total = prompt + completion; cumulative over outputs")
def usage_accounting(t: Target) -> str:
    """G16: usage placement and arithmetic, for one and for several outputs."""
    ids = t.known_token_ids()[:6]
    res = expect_valid(t.generate(t.request("g16", token_ids=ids, max_tokens=5, ignore_eos=True)))
    usage = res.usage()
    expect([i for i, e in enumerate(res.events) if e.HasField("usage")] == [len(res.events) - 1],
           f"usage on events {[i for i, e in enumerate(res.events) if e.HasField('usage')]}, expected only the last")
    expect(usage.prompt_tokens == len(ids), f"usage.prompt_tokens {usage.prompt_tokens} for {len(ids)} token ids")
    expect(usage.completion_tokens == 5, f"usage.completion_tokens {usage.completion_tokens} for 5 tokens")
    problems = usage_violations(usage)
    expect(not problems, "; ".join(problems))
    if not t.max_num_sequences or t.max_num_sequences < 3:
        return "single output checked; num_sequences 3 not advertised"
    req = t.request("g16", token_ids=ids, max_tokens=4, temperature=1.0, ignore_eos=True)
    req.sampling.num_sequences, req.sampling.seed = 3, 9
    res = expect_valid(t.generate(req), num_sequences=3)
    usage = res.usage()
    produced = sum(len(res.tokens(i)) for i in range(3))
    expect(usage.completion_tokens == produced,
           f"3 outputs of 4 tokens: usage.completion_tokens {usage.completion_tokens}, produced {produced}")
    expect(usage.prompt_tokens in (len(ids), 3 * len(ids)),
           f"prompt_tokens {usage.prompt_tokens} with 3 outputs of a {len(ids)}-token prompt")
    expect(res.events[-1].WhichOneof("event") == "finished", "final event with 3 outputs is not a finish")
    return "single and 3-output usage consistent"
