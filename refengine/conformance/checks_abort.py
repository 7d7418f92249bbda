"""Section A — Abort and client cancellation (A1–A5)."""

from __future__ import annotations

import time
from typing import Any

import grpc

from refengine.conformance.assertions import (
    expect_finish,
    expect_valid,
    settled,
    skip_if_cut_short,
    skip_if_done_before_deadline,
    stream_violations,
)
from refengine.conformance.enums import enum_name
from refengine.conformance.registry import check, expect, skip
from refengine.conformance.streams import Background, StreamResult
from refengine.conformance.target import Target
from refengine.protocol import oe

#: A5's request length. A cancel comes after 4 events, so a server that aborts never runs most of
#: it; one that does not is told from one that does by the time it would take (``_stopped_early``).
#: At 400 tokens a GPU server streaming 1,000 tokens/s ends within 0.4 s, too soon to tell.
A5_MAX_TOKENS = 2000


def _long(t: Target, tag: str, n: int = 1, cap: int = 400) -> Any:
    req = t.long_request(tag, cap=cap, temperature=1.0 if n > 1 else 0.0)
    if n > 1:
        req.sampling.num_sequences, req.sampling.seed = n, 21
    return req


def _start(t: Target, req: Any) -> Background:
    """Start a stream on a thread, once the server has accepted it (``Target.start_stream``)."""
    call, accepted = t.start_stream(req)
    if not accepted:
        res = call.join()
        expect(False, f"{req.request_id} was not seen accepted (no event, no GetLoad count): {res.describe()}")
    return call


@check("A1", "Abort without a target → INVALID_ARGUMENT")
def abort_no_target(t: Target) -> str:
    """A1: exactly one target."""
    code, _ = t.unary_code("Abort", oe.AbortRequest())
    expect(code == grpc.StatusCode.INVALID_ARGUMENT, f"Abort() returned {code.name}, expected INVALID_ARGUMENT")
    return "INVALID_ARGUMENT"


@check("A2", "unknown request_id / kv_session → NOT_FOUND; a finished request → ALREADY_FINISHED")
def abort_unknown_and_finished(t: Target) -> str:
    """A2: Abort outcomes for ids that are not running."""
    code, _ = t.unary_code("Abort", oe.AbortRequest(request_id=t.new_id("a2-never-sent")))
    expect(code == grpc.StatusCode.NOT_FOUND, f"Abort(unknown request_id) returned {code.name}, expected NOT_FOUND")
    session = oe.KvSessionRef(session_id="oeconf-no-such-session", transfer_backend="grpc")
    code, _ = t.unary_code("Abort", oe.AbortRequest(kv_session=session))
    expect(code == grpc.StatusCode.NOT_FOUND, f"Abort(unknown kv_session) returned {code.name}, expected NOT_FOUND")
    req = t.request("a2", max_tokens=2)
    expect_valid(t.generate(req))
    code, resp = t.unary_code("Abort", oe.AbortRequest(request_id=req.request_id))
    expect(code == grpc.StatusCode.OK, f"Abort(finished request) returned {code.name}, expected OK/ALREADY_FINISHED")
    expect(resp.status == oe.ABORT_STATUS_ALREADY_FINISHED,
           f"Abort(finished request) status {enum_name(oe.AbortStatus, resp.status)}, expected ALREADY_FINISHED")
    return "NOT_FOUND for unknown ids, ALREADY_FINISHED for a finished one"


@check("A3", "all_requests aborts everything (ABORTED), or ALREADY_FINISHED when nothing ran")
def abort_all(t: Target) -> str:
    """A3: ``all_requests {}``; the aborted requests' KV is released (back to what was used before
    them: found by review, a server that kept it passed A3 and its leak became the next checks'
    idle value)."""
    base = settled(t, "A3 before") if t.has_load else None
    code, resp = t.unary_code("Abort", oe.AbortRequest(all_requests=oe.AllRequests()))
    expect(code == grpc.StatusCode.OK, f"Abort(all) on an idle server returned {code.name}")
    expect(resp.status in (oe.ABORT_STATUS_ALREADY_FINISHED, oe.ABORT_STATUS_ABORTED),
           f"Abort(all) on an idle server: status {enum_name(oe.AbortStatus, resp.status)}")
    idle_status = enum_name(oe.AbortStatus, resp.status)
    slots = _running_slots(t) if base is not None else None
    reqs = [_long(t, "a3") for _ in range(slots + 1 if slots else 2)]
    calls = [_start(t, r) for r in reqs]
    what = f"{len(reqs)} requests ({len(reqs) - 1} running, one queued)" if slots else "2 running requests"
    if slots:
        load = t.wait_until(lambda lo: lo.queued_requests >= 1, timeout=5)
        expect(load.queued_requests >= 1, f"{len(reqs)} long requests with max_running_requests {slots}: none queued")
    _skip_if_ended(calls, "Abort(all)")
    code, resp = t.unary_code("Abort", oe.AbortRequest(all_requests=oe.AllRequests()))
    results = [c.join() for c in calls]
    expect(code == grpc.StatusCode.OK and resp.status == oe.ABORT_STATUS_ABORTED,
           f"Abort(all) with {what}: {code.name} "
           f"{enum_name(oe.AbortStatus, resp.status) if resp else ''}, expected ABORTED")
    for res in results:
        expect_valid(res, what="stream aborted by all_requests")
        expect_finish(res, oe.FINISH_REASON_CANCELLED, what=f"stream aborted by all_requests ({what})")
    if base is None:  # GetLoad is optional (profile load): the release cannot be seen without it
        return f"idle: {idle_status}; {what} CANCELLED; KV release not observed (no GetLoad)"
    t.wait_idle("A3: after Abort(all)", baseline=base.used_kv_blocks)
    return f"idle: {idle_status}; {what} CANCELLED; KV released"


def _running_slots(t: Target) -> int | None:
    """max_running_requests when reported and small enough (at most 7) to queue a request behind
    it (found by review: A3 sent two, so a server whose Abort(all) skipped queued requests passed)."""
    cap = t.server_info.capacity
    slots = cap.max_running_requests if cap.HasField("max_running_requests") else 0
    return slots if 0 < slots <= 7 else None


def _skip_if_ended(calls: list[Background], what: str) -> None:
    """Skip when a stream ended before ``what`` was sent: it ran to its end first (a server without
    GetLoad that sends each output in one TokenOutput is seen accepted only then; found by review)."""
    if any(c.done() for c in calls):
        skip(f"a long request ended before {what} could be sent: nothing left to abort")


@check("A4", "Abort(request_id) ends every unfinished output with CANCELLED and frees its KV")
def abort_running(t: Target) -> str:
    """A4: one GenerationFinished(CANCELLED) per unfinished output (ref), KV freed (back to what
    was used before it started: blocks an earlier check left are that check's finding). Without
    GetLoad (optional) the KV release cannot be seen; the CANCELLED finishes are still checked."""
    base = settled(t, "A4 before") if t.has_load else None
    n = 2 if (t.max_num_sequences or 1) >= 2 else 1
    req = _long(t, "a4", n)
    call = _start(t, req)
    _skip_if_ended([call], "Abort(request_id)")
    load = t.load() if base is not None else None
    busy_blocks = load.used_kv_blocks if load is not None and load.HasField("used_kv_blocks") else None
    code, resp = t.unary_code("Abort", oe.AbortRequest(request_id=req.request_id))
    res = call.join()
    expect(code == grpc.StatusCode.OK and resp.status == oe.ABORT_STATUS_ABORTED,
           f"Abort(running) returned {code.name} {enum_name(oe.AbortStatus, resp.status) if resp else ''}")
    expect_valid(res, num_sequences=n, what="aborted stream")
    for i in range(n):
        expect_finish(res, oe.FINISH_REASON_CANCELLED, index=i, what="aborted output")
    expect(len(res.tokens()) < req.stopping.max_tokens, "the aborted request ran to max_tokens")
    kv = "KV release not observed (GetLoad unavailable)"
    if base is not None:
        load = t.wait_idle("A4: after Abort", baseline=base.used_kv_blocks)
        kv = f"used_kv_blocks {busy_blocks} -> {load.used_kv_blocks}"
    # Only "still running" is A4's finding; ALREADY_FINISHED vs NOT_FOUND for a finished id is A2's.
    code, resp = t.unary_code("Abort", oe.AbortRequest(request_id=req.request_id))
    expect(not (code == grpc.StatusCode.OK and resp.status == oe.ABORT_STATUS_ABORTED),
           "a second Abort found the request still running (ABORTED) after its CANCELLED finish")
    return f"{n} output(s) CANCELLED; {kv}"


def _natural_end_s(res: StreamResult, max_tokens: int) -> float | None:
    """How much longer the request would have run by itself, at the fastest rate it streamed
    before the client let go (tokens after the first event ÷ the time since it); None when its
    events cannot tell (fewer than two TokenOutputs)."""
    stamps = [(at, len(e.token.tokens)) for e, at in zip(res.events, res.times, strict=False)
              if e.WhichOneof("event") == "token"]
    if len(stamps) < 2 or stamps[-1][0] <= stamps[0][0]:
        return None
    rate = sum(n for _, n in stamps[1:]) / (stamps[-1][0] - stamps[0][0])
    return (max_tokens - sum(n for _, n in stamps)) / rate if rate > 0 else None


def _stopped_early(waited_s: float, natural_s: float | None, what: str) -> str:
    """A5: the server went idle well before the request would have ended by itself (found by
    review: only idleness within the idle timeout was asked, so a server running a cancelled
    request to its end passed whenever that end came first)."""
    if natural_s is None or natural_s < 1.0:
        return "; an abort cannot be told from its natural end (under 1 s away)"
    expect(waited_s < 0.5 * natural_s,
           f"{what}: idle {waited_s:.2f} s later, about when the request would have ended by itself "
           f"({natural_s:.2f} s at the rate it streamed): the engine work went on")
    return f"; it would have run {natural_s:.1f} s more"


@check("A5", "cancelling the call (client cancel) aborts the engine work: GetLoad returns to idle")
def client_cancel(t: Target) -> str:
    """A5: a client cancel frees the request (running count and KV back to where they were)."""
    base = settled(t, "A5 before")
    req = _long(t, "a5", cap=A5_MAX_TOKENS)
    res = t.generate(req, on_event=t.canceller(after_events=4))
    skip_if_cut_short(res, "a long request before its cancel")
    if res.ok and res.finished() is not None and len(res.events) < 4:  # one TokenOutput per output (G11 allows it)
        skip(f"the long request ended in {len(res.events)} events before the cancel: nothing left to abort")
    expect(res.code == grpc.StatusCode.CANCELLED or len(res.events) == 4,
           f"the client cancel did not end the call: {res.describe()}")
    start = time.monotonic()
    load = t.wait_idle("A5: after the client cancelled the call", baseline=base.used_kv_blocks)
    waited = time.monotonic() - start
    code, resp = t.unary_code("Abort", oe.AbortRequest(request_id=req.request_id))
    expect(not (code == grpc.StatusCode.OK and resp.status == oe.ABORT_STATUS_ABORTED),
           "Abort after the client cancel found the request still running")
    early = _stopped_early(waited, _natural_end_s(res, req.stopping.max_tokens), "after the client cancel")
    return f"idle {waited:.2f} s after cancel (used_kv_blocks {load.used_kv_blocks}){early}"


@check("A5", "closing the channel (client disconnect) aborts the engine work")
def client_disconnect(t: Target) -> str:
    """A5: a client that goes away (its channel closed) frees the request."""
    base = settled(t, "A5 before")
    req = _long(t, "a5d", cap=A5_MAX_TOKENS)
    seen = StreamResult(request_id=req.request_id, started=time.perf_counter())
    channel = grpc.insecure_channel(t.address)
    refused = "ended OK without an event"
    try:  # the channel is closed on every path: left open, it would keep the request alive
        for event in oe.InferenceStub(channel).Generate(req, timeout=t.options.stream_timeout_s):
            seen.events.append(event)  # what they carry (request_id, ...) is G9's and the others' to judge
            seen.times.append(time.perf_counter())
            if len(seen.events) >= 4:
                break
    except grpc.RpcError as err:
        refused = f"{err.code().name}: {err.details()}"
    finally:
        channel.close()
    expect(bool(seen.events), f"a long request produced no event before the disconnect ({refused})")
    start = time.monotonic()
    load = t.wait_idle("A5: after the client closed its channel", baseline=base.used_kv_blocks)
    early = _stopped_early(time.monotonic() - start, _natural_end_s(seen, req.stopping.max_tokens),
                           "after the client closed its channel")
    return f"idle after disconnect (used_kv_blocks {load.used_kv_blocks}){early}"


@check("A5", "a client deadline expiring mid-stream aborts the engine work")
def client_deadline(t: Target) -> str:
    """A5 (with X1): a deadline ends the call with DEADLINE_EXCEEDED (no synthesized
    EngineError) and the engine stops the request."""
    base = settled(t, "A5 before")
    req = t.long_request("a5t", cap=4000)
    res = t.generate(req, timeout=1.5)
    skip_if_cut_short(res, "a long request before its deadline")
    skip_if_done_before_deadline(res, 1.5, f"a {req.stopping.max_tokens}-token request")
    expect(res.code == grpc.StatusCode.DEADLINE_EXCEEDED,
           f"a 1.5 s deadline on a {req.stopping.max_tokens}-token request ended with {res.describe()}")
    problems = [p for p in stream_violations(res, cancelled_ok=True) if not p.startswith("G12")]
    expect(not res.of("error"), "a client deadline produced an EngineError event (transport failures are a "
                                "status only)")
    expect(not problems, "; ".join(problems))
    start = time.monotonic()
    t.wait_idle("A5: after the deadline expired", baseline=base.used_kv_blocks)
    early = _stopped_early(time.monotonic() - start, _natural_end_s(res, req.stopping.max_tokens),
                           "after the client deadline")
    return f"DEADLINE_EXCEEDED after {len(res.events)} events; idle again{early}"
