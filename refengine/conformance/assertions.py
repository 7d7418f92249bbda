"""Assertions shared by the checks: rejection before acceptance, the structural invariants
every Generate stream must satisfy (G9, G10, G11, G12, G16, X1), and the idle baseline of
the checks that judge a release of work (A4, A5, H4).

Each check owns the rule it names, and only that rule: a structural problem is tagged with
its rule id (``"G10: ..."``), and a check sees only the problems of its own rule
(``StreamResult.rule``, set by the runner). So a server that omits ``output_index`` fails
G10 alone, not every check that happens to read a stream; the G10 check finds it, and so do
the run-wide checks (:mod:`checks_structure`) in any other check's stream.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import grpc

from refengine.conformance.enums import enum_name
from refengine.conformance.registry import CheckFailed, CheckSkipped, skip
from refengine.conformance.streams import StreamResult
from refengine.conformance.target import Target
from refengine.protocol import oe

INVALID = (grpc.StatusCode.INVALID_ARGUMENT,)
NON_OK = tuple(c for c in grpc.StatusCode if c != grpc.StatusCode.OK)
TRANSPORT_CODES = (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
#: Rules whose checks judge an output's GenerationFinished themselves: Abort ends every output
#: CANCELLED (A4), a decode stream ends with one (K9). Any other check skips a stream missing
#: one (:func:`expect_valid`): it is G12's finding.
FINISH_RULES = frozenset({"A4", "K9"})
MISSING_FINISH = "G12: stream ended OK without GenerationFinished"


def expect_rejected(res: StreamResult, codes: Iterable[grpc.StatusCode] = INVALID, what: str = "") -> None:
    """X1: a request refused before acceptance gets a non-OK status in ``codes`` and no event."""
    codes = tuple(codes)
    label = f"{what}: " if what else ""
    wanted = "a non-OK status" if set(codes) == set(NON_OK) else "/".join(c.name for c in codes)
    if res.ok:
        raise CheckFailed(f"{label}expected {wanted} before acceptance, got an accepted stream ({res.describe()})")
    if res.events:
        raise CheckFailed(f"{label}rejection {res.code.name} came after {len(res.events)} event(s) "
                          f"{res.kinds()}; a refusal before acceptance has zero events")
    if res.code not in codes:
        raise CheckFailed(f"{label}expected {wanted}, got {res.code.name} ({res.details!r})")


def stream_violations(res: StreamResult, num_sequences: int = 1, cancelled_ok: bool = False) -> list[str]:
    """The ways a completed stream breaks the structural rules that ``res.rule`` owns (all of
    them when ``res.rule`` is empty); empty = fine.

    Checks: G9 request_id echoed; G10 output_index present and in range; G11 text deltas
    not cumulative; G12 one finish per output, nothing after it, never UNSPECIFIED; G16
    usage only on the final event and consistent; X1 an EngineError is the last event and
    the status is OK. ``cancelled_ok`` allows a client-cancelled status (the stream was cut)."""
    every = _all_violations(res, num_sequences, cancelled_ok)
    _record(res, every)
    return _owned(every, res.rule)


def record_structure(res: StreamResult, num_sequences: int = 1, finish_judged: bool = False) -> None:
    """Leave the structural problems of a stream that its check does not judge itself (a PREFILL
    or DECODE stream) for the run-wide checks; ``finish_judged``: its missing GenerationFinished
    is another rule's finding (a decode's: K9), not G12's."""
    _record(res, _all_violations(res, num_sequences, False), finish_judged)


def _record(res: StreamResult, problems: list[str], finish_judged: bool = False) -> None:
    """Leave the problems of other rules for the run-wide checks (:mod:`stream_ledger`); not a
    missing finish in the streams of :data:`FINISH_RULES`, whose checks judge it."""
    if res.ledger is not None:
        owned_finish = finish_judged or res.rule in FINISH_RULES
        res.ledger.record(res, [p for p in problems if not (owned_finish and p.startswith(MISSING_FINISH))])


def _owned(problems: list[str], rule: str) -> list[str]:
    """The problems ``rule`` owns (each starts with its rule id); all of them for no rule."""
    return [p for p in problems if not rule or p.split(":", 1)[0] == rule]


def _all_violations(res: StreamResult, num_sequences: int, cancelled_ok: bool) -> list[str]:
    problems: list[str] = []
    unindexed = False
    finished: set[int] = set()
    final = len(res.events) - 1
    for i, event in enumerate(res.events):
        kind = event.WhichOneof("event")
        if event.request_id != res.request_id:
            problems.append(f"G9: event {i} ({kind}) has request_id {event.request_id!r}, sent {res.request_id!r}")
        if kind is None:
            problems.append(f"G12: event {i} has no event set")
            continue
        if event.HasField("usage") and i != final:
            problems.append(f"G16: usage on event {i} ({kind}), not on the final response (event {final})")
        if kind in ("token", "finished"):
            body = getattr(event, kind)
            if not body.HasField("output_index"):  # G10's finding; unattributable for G12
                problems.append(f"G10: {kind} event {i} has no output_index (must be present, also 0)")
                unindexed = True
                continue
            index = body.output_index
            if index >= num_sequences:
                problems.append(f"G10: {kind} event {i} has output_index {index}, num_sequences {num_sequences}")
            if index in finished:
                problems.append(f"G12: {kind} event {i} for output {index} after its GenerationFinished")
            if kind == "finished":
                finished.add(index)
                if body.reason == oe.FINISH_REASON_UNSPECIFIED:
                    problems.append(f"G12: GenerationFinished for output {index} has reason UNSPECIFIED")
        if kind == "error" and i != final:
            problems.append(f"X1: EngineError at event {i} is followed by {final - i} more event(s)")
    cumulative = cumulative_outputs(res)
    problems.extend(f"G11: output {index}: each TokenOutput.text repeats all the text before it (cumulative, "
                    "not a delta)" for index in cumulative)
    problems.extend(f"G11: output {index}: its TokenOutput texts hold {extra} more non-space character(s) than its "
                    "tokens' own texts (TokenInfo.token): the deltas overlap" for index, extra in
                    overlapping_outputs(res) if index not in cumulative)
    errors = res.of("error")
    if res.ok and not errors and res.events:
        missing = set(range(num_sequences)) - finished
        if missing and not res.of("prefill_ready") and not unindexed:
            problems.append(f"{MISSING_FINISH} for output(s) {sorted(missing)}")
        if not res.events[-1].HasField("usage"):
            problems.append(f"G16: the final response ({res.kinds()[-1]}) carries no usage")
    if errors and not res.ok:
        problems.append(f"X1: status {res.code.name} after an EngineError (the stream must then end OK)")
    if res.ok and not res.events:
        problems.append("G12: stream ended OK with no event at all")
    if not res.ok and not (cancelled_ok and res.code in TRANSPORT_CODES) and res.events:
        problems.append(f"X1: stream failed with {res.code.name} after {len(res.events)} event(s); after "
                        "acceptance a failure is one EngineError event, then OK")
    usage = res.usage()
    if usage is not None:
        problems.extend(usage_violations(usage))
    return problems


def cumulative_outputs(res: StreamResult) -> list[int]:
    """G11: the outputs whose text deltas are cumulative: every non-empty delta extends the one
    before it and the texts are longer in total than the tokens' own texts (a real delta stream
    is at most as long, so a repeated character is no false alarm)."""
    found = []
    for index in sorted({t.output_index for t in res.of("token")}):
        events = res.token_events(index)
        texts = [e.text for e in events if e.text]
        pieces = sum(len(info.token) for e in events for info in e.tokens)
        if len(texts) >= 2 and pieces and sum(map(len, texts)) > pieces and \
                all(b.startswith(a) and len(b) > len(a) for a, b in zip(texts, texts[1:], strict=False)):
            found.append(index)
    return found


def overlapping_outputs(res: StreamResult) -> list[tuple[int, int]]:
    """G11: (output, extra characters) for the outputs whose delta texts, put together, hold more
    non-space characters than their tokens' own texts (found by review: deltas repeating the last
    character of the delta before passed). Text may legitimately be shorter (special tokens, a
    character split over byte tokens, text cut at a stop) and differ in spaces (a tokenizer's
    leading-space and clean-up rules), never longer: judged where every token but the last has its
    text, and not where a stop string or token ended the output (a stop string may end inside a
    token kept out; a stop token's text sent without it is G14's finding), nor where the text holds
    U+FFFD: a byte-fallback tokenizer renders an invalid byte run as one per byte, while a byte
    token's own text may be a character it completes alone (found by review: a false G11 failure)."""
    found = []
    for index in sorted({t.output_index for t in res.of("token")}):
        infos, fin = res.token_infos(index), res.finished(index)
        if len(res.token_events(index)) < 2 or not infos or not all(info.token for info in infos[:-1]) \
                or "\ufffd" in res.text(index):
            continue
        if fin is not None and fin.stop_match.WhichOneof("match") in ("stop_text", "stop_token_id"):
            continue
        extra = _visible(res.text(index)) - _visible("".join(info.token for info in infos))
        if extra > 0:
            found.append((index, extra))
    return found


def _visible(text: str) -> int:
    return sum(1 for c in text if not c.isspace())


def usage_violations(usage: Any) -> list[str]:
    """G16 arithmetic: total = prompt + completion, cached <= prompt, reasoning <= completion."""
    problems = []
    if usage.total_tokens != usage.prompt_tokens + usage.completion_tokens:
        problems.append(f"G16: usage total {usage.total_tokens} != prompt {usage.prompt_tokens} + "
                        f"completion {usage.completion_tokens}")
    if usage.HasField("cached_prompt_tokens") and usage.cached_prompt_tokens > usage.prompt_tokens:
        problems.append(f"G16: cached_prompt_tokens {usage.cached_prompt_tokens} > prompt {usage.prompt_tokens}")
    if usage.HasField("reasoning_tokens") and usage.reasoning_tokens > usage.completion_tokens:
        problems.append(f"G16: reasoning_tokens {usage.reasoning_tokens} > completion {usage.completion_tokens}")
    return problems


def expect_valid(res: StreamResult, num_sequences: int = 1, what: str = "") -> StreamResult:
    """The stream was accepted, ended OK, and has none of the structural problems of the
    check's own rule (:func:`stream_violations`)."""
    label = f"{what}: " if what else ""
    if not res.ok:
        raise CheckFailed(f"{label}expected an accepted stream ending OK, got {res.describe()}")
    if res.of("error"):
        err = res.of("error")[0]
        raise CheckFailed(f"{label}stream ended with EngineError {enum_name(oe.ErrorCode, err.code)}: {err.message!r}")
    every = _all_violations(res, num_sequences, False)
    _record(res, every)
    problems = _owned(every, res.rule)
    if problems:
        raise CheckFailed(f"{label}" + "; ".join(problems[:4]))
    unreadable = [p for p in every if p.startswith("G12:")]
    if unreadable and res.rule not in FINISH_RULES:  # what the output was cannot be told
        raise CheckSkipped(f"{label}the output cannot be read: {unreadable[0]} (G12 fails for it)")
    if res.rule != "G11" and (cumulative_outputs(res) or overlapping_outputs(res)):
        raise CheckSkipped(f"{label}the output cannot be read: its TokenOutput texts are not deltas (cumulative or "
                           "overlapping; G11 fails for it)")
    if num_sequences > 1 and res.rule != "G10" and unindexed_events(res):
        raise CheckSkipped(f"{label}{num_sequences} outputs cannot be told apart: {unindexed_events(res)} event(s) "
                           "carry no output_index (G10 fails for it)")
    return res


def skip_if_cut_short(res: StreamResult, what: str) -> None:
    """Skip when a stream ended OK with events but no GenerationFinished, EngineError or
    PrefillReady: it ended before the check's own action (a cancel, a deadline) could matter,
    so only G12 can judge it."""
    if res.ok and res.events and not (res.of("finished") or res.of("error") or res.of("prefill_ready")):
        skip(f"{what}: the stream ended OK after {len(res.events)} event(s) without GenerationFinished (G12 fails "
             "for it)")


def skip_if_done_before_deadline(res: StreamResult, deadline_s: float, what: str) -> None:
    """Skip when a stream meant to outlive a client deadline ended OK before it: a fast server
    ran the whole request first (the deadline is the client's own, so an OK status means it had
    not expired). Nothing was cut, so nothing about a transport failure can be judged."""
    if res.ok:
        skip(f"{what} ended OK ({len(res.events)} event(s), {res.kinds()[-1] if res.events else 'none'} last) "
             f"before its {deadline_s:g} s deadline: the server finished it first, no transport failure provoked")


def unindexed_events(res: StreamResult) -> int:
    """TokenOutput and GenerationFinished events without ``output_index`` (G10)."""
    return sum(1 for e in res.events if e.WhichOneof("event") in ("token", "finished")
               and not getattr(e, e.WhichOneof("event")).HasField("output_index"))


def expect_finish(res: StreamResult, reason: int, index: int = 0, what: str = "") -> Any:
    fin = res.finished(index)
    label = f"{what}: " if what else ""
    if fin is None:
        raise CheckFailed(f"{label}no GenerationFinished for output {index} ({res.describe()})")
    if fin.reason != reason and fin.reason not in oe.FinishReason.values():
        raise CheckSkipped(f"{label}output {index} finished with reason {fin.reason}, not in the release "
                           "(X4 fails for it)")
    if fin.reason != reason:
        raise CheckFailed(f"{label}output {index} finished {enum_name(oe.FinishReason, fin.reason)}, expected "
                          f"{enum_name(oe.FinishReason, reason)} (stop_match {fin.stop_match.WhichOneof('match')})")
    return fin


def settled(t: Target, what: str) -> Any:
    """Wait until no request runs or waits; returns that LoadInfo: the baseline to which a check
    of an idleness rule (A4, A5, H4) expects its own work to return (``t.wait_idle(what,
    baseline=load.used_kv_blocks)``). KV blocks an earlier check left behind are that check's
    finding; earlier work still running after the idle timeout leaves nothing to judge (skip), and
    so does a target without GetLoad (an optional RPC)."""
    t.need_load(f"{what}: the release of work and KV")
    load = t.wait_until(lambda lo: lo.running_requests == 0 and lo.queued_requests == 0)
    t.need_counts(load, f"{what}: the release of work")
    if load.running_requests or load.queued_requests:
        skip(f"{what}: earlier work still runs after {t.options.idle_timeout_s:.0f} s (running="
             f"{load.running_requests} queued={load.queued_requests}): this check's own release cannot be judged")
    return load


def is_finite(x: float) -> bool:
    return isinstance(x, float | int) and math.isfinite(x)
