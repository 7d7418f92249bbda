"""Section K, disaggregated prefill/decode (K4–K10, with A2 and X3 where they meet).

These checks need a pair: ``--prefill HOST:PORT`` and ``--decode HOST:PORT`` (they skip,
saying so, without one). What a framework sees: a prefill server's stream is exactly one
``PrefillReady`` with a routable ``KvSessionRef`` and ``Usage`` (K4); the decode server
takes that session unchanged and streams tokens (K9); it refuses a malformed session and
a request without one before acceptance (K5), as the prefill server refuses a session
(K6); ``Abort(kv_session)`` frees a held session, after which it is unknown (A2, K7) and a
decode of it ends with exactly one not-retryable ``EngineError`` (K8, X3). K10 compares a
greedy prefill → decode output with the target's when the target is AGGREGATED.
"""

from __future__ import annotations

import functools
from typing import Any

import grpc
from google.protobuf import struct_pb2

from refengine.conformance.assertions import expect_rejected, record_structure, settled
from refengine.conformance.enums import enum_name
from refengine.conformance.hosts import is_routable
from refengine.conformance.registry import check, expect, skip
from refengine.conformance.streams import StreamResult
from refengine.conformance.target import Target
from refengine.protocol import oe


def _pair(t: Target) -> tuple[Target, Target]:
    """The connected prefill and decode targets (cached on ``t``)."""
    if not (t.options.prefill_address and t.options.decode_address):
        skip("needs a disaggregated pair: run with --prefill HOST:PORT --decode HOST:PORT")
    if "k_pair" not in t.cache:
        pair = (t.connect_peer(t.options.prefill_address, "--prefill"),
                t.connect_peer(t.options.decode_address, "--decode"))
        roles = [p.server_info.engine_role for p in pair]
        expect(roles == [oe.ENGINE_ROLE_PREFILL, oe.ENGINE_ROLE_DECODE],
               f"--prefill/--decode report roles {[enum_name(oe.EngineRole, r) for r in roles]}")
        t.cache["k_pair"] = pair
    for peer in t.cache["k_pair"]:  # judged by the running check's rule: a leak another check waits out is
        peer.rule, peer.check = t.rule, t.check  # that rule's finding there, not this one's (wait_idle)
    return t.cache["k_pair"]


def _prefill(pre: Target, tag: str) -> tuple[oe.GenerateRequest, StreamResult]:
    """A prefill of ``tag``; its structure (G9, G10, G16 ...) is left for the run-wide checks
    (found by review: PREFILL and DECODE streams were never judged on it)."""
    req = pre.request(tag, max_tokens=8)
    stream = pre.generate(req)
    record_structure(stream)
    return req, stream


def _session(stream: StreamResult) -> oe.KvSessionRef:
    ready = stream.of("prefill_ready")
    expect(stream.ok and len(ready) == 1, f"no PrefillReady: {stream.describe()}")
    return ready[0].kv_session


def _decode(dec: Target, req: oe.GenerateRequest, session: oe.KvSessionRef,
            metadata: list[tuple[str, str]] | None = None) -> StreamResult:
    decode_req = oe.GenerateRequest()
    decode_req.CopyFrom(req)
    decode_req.request_id = dec.new_id("k-decode")
    decode_req.kv.session.CopyFrom(session)
    stream = dec.generate(decode_req, metadata=metadata)
    record_structure(stream, finish_judged=True)  # a decode's missing finish is K9's finding, not G12's
    return stream


@check("K4", "a PREFILL stream is one PrefillReady with a routable KvSessionRef and Usage")
def prefill_ready_only(t: Target) -> str:
    pre, _ = _pair(t)
    _, stream = _prefill(pre, "k4")
    expect(stream.kinds() == ["prefill_ready"], f"events {stream.kinds()}: no TokenOutput may leak, "
           "no GenerationFinished follows")
    session = _session(stream)
    expect(bool(session.session_id) and bool(session.transfer_backend), "session_id and transfer_backend are set")
    # Port 0: a transport without ports, as K5's check allows (found by review: K4 refused it).
    expect(bool(session.endpoints) and all(is_routable(e.host, e.port or 1) for e in session.endpoints),
           f"endpoints must be routable hosts (never a wildcard), each port 1..65535 or 0 (no port): "
           f"{list(session.endpoints)}")
    expect(stream.events[-1].HasField("usage") and stream.events[-1].usage.prompt_tokens > 0,
           "PrefillReady carries Usage")
    pre.unary("Abort", oe.AbortRequest(kv_session=session))
    return f"backend {session.transfer_backend}, {len(session.attributes_struct)} attributes"


def _inexact_numbers(value: Any, path: str) -> list[str]:
    """``path=value`` of each number in a Struct/ListValue/Value tree above 2^53 in magnitude."""
    if isinstance(value, struct_pb2.Struct):
        return [p for key, item in value.fields.items() for p in _inexact_numbers(item, f"{path}.{key}")]
    if isinstance(value, struct_pb2.ListValue):
        return [p for i, item in enumerate(value.values) for p in _inexact_numbers(item, f"{path}[{i}]")]
    kind = value.WhichOneof("kind")
    if kind in ("struct_value", "list_value"):
        return _inexact_numbers(getattr(value, kind), path)
    if kind == "number_value" and abs(value.number_value) > 2.0 ** 53:
        return [f"{path}={value.number_value!r}"]
    return []


@check("K9", "the decode server takes the session unchanged and streams tokens")
def forwarded_session_decodes(t: Target) -> str:
    """K9: no number in ``attributes_struct`` is past 2^53 (a JSON number cannot hold such an
    identifier exactly: it travels as a decimal string; found by review: unchecked), and the
    decode server decodes the session forwarded unchanged."""
    pre, dec = _pair(t)
    req, stream = _prefill(pre, "k9")
    inexact = _inexact_numbers(_session(stream).attributes_struct, "attributes_struct")
    expect(not inexact, f"numbers above 2^53 (64-bit values must travel as decimal strings): {inexact[:3]}")
    out = _decode(dec, req, _session(stream))
    expect(out.ok and out.tokens() and out.finished() is not None and not out.of("error"),
           f"decode of a forwarded session: {out.describe()}")
    return f"{len(out.tokens())} tokens"


@check("K5", "DECODE refuses a request without a session, or with a malformed one, before acceptance")
def decode_refuses_bad_sessions(t: Target) -> str:
    pre, dec = _pair(t)
    req, stream = _prefill(pre, "k5")
    good = _session(stream)
    malformed = {name: oe.KvSessionRef() for name in ("unknown backend", "empty session_id", "no endpoints",
                                                      "endpoint port 0")}
    for session in malformed.values():
        session.CopyFrom(good)
    malformed["unknown backend"].transfer_backend = "no-such-backend"
    malformed["empty session_id"].session_id = ""
    malformed["no endpoints"].ClearField("endpoints")  # K5 names the endpoints (found by review: unchecked)
    for endpoint in malformed["endpoint port 0"].endpoints:
        endpoint.port = 0
    if any(endpoint.port == 0 for endpoint in good.endpoints):  # a transport without ports: not malformed there
        del malformed["endpoint port 0"]
    without = dec.generate(dec.request("k5-none", max_tokens=8))
    expect(not without.ok and not without.events, f"no session: {without.describe()}")
    for name, session in malformed.items():
        out = _decode(dec, req, session)
        expect(out.code == grpc.StatusCode.INVALID_ARGUMENT and not out.events, f"{name}: {out.describe()}")
    pre.unary("Abort", oe.AbortRequest(kv_session=good))
    return f"{len(malformed) + 1} refused"


@check("M3", "DECODE: a target-dp-rank contradicting the session's dp_rank → INVALID_ARGUMENT, session kept")
def decode_session_rank_conflict(t: Target) -> str:
    """M3 where a session is meant to go (found by review: M3 was sent only to the target, where
    a session is also a role mismatch, so a DECODE server routing by the header passed). A real
    session, so that only the header is wrong; the refusal must lose nothing: the same request
    with the agreeing header then decodes."""
    pre, dec = _pair(t)
    req, stream = _prefill(pre, "m3d")
    session = _session(stream)
    rank = [("openengine-target-dp-rank", str(session.dp_rank))]
    conflicting = [("openengine-target-dp-rank", str((session.dp_rank + 1) % 2**32))]
    refused = _decode(dec, req, session, metadata=conflicting)
    decoded = _decode(dec, req, session, metadata=rank) if not refused.ok else None
    if decoded is None or not decoded.ok:
        pre.unary_code("Abort", oe.AbortRequest(kv_session=session))  # held otherwise until its lease ends
    expect_rejected(refused, codes=(grpc.StatusCode.INVALID_ARGUMENT,),
                    what=f"session dp_rank {session.dp_rank} with target-dp-rank {conflicting[0][1]}")
    expect(decoded is not None and decoded.ok and bool(decoded.tokens()) and not decoded.of("error"),
           f"after the refusal, the same session with target-dp-rank {session.dp_rank}: "
           f"{decoded.describe() if decoded else 'not sent'}")
    return f"refused with {refused.code.name}; the session then decoded {len(decoded.tokens())} tokens"


@check("K6", "a session sent to a PREFILL server is refused before acceptance")
def prefill_refuses_a_session(t: Target) -> str:
    pre, _ = _pair(t)
    req, stream = _prefill(pre, "k6")
    session = _session(stream)
    again = oe.GenerateRequest()
    again.CopyFrom(req)
    again.request_id = pre.new_id("k6-again")
    again.kv.session.CopyFrom(session)
    out = pre.generate(again)
    expect(not out.ok and not out.events, f"session on a PREFILL server: {out.describe()}")
    pre.unary("Abort", oe.AbortRequest(kv_session=session))
    return out.code.name


@check("K7", "Abort(kv_session) releases the session; it is unknown afterwards (A2)")
def abort_releases_the_session(t: Target) -> str:
    """K7: the prefill server's KV returns to what it held before this check's session (a
    session an earlier check left held is that check's finding)."""
    pre, _ = _pair(t)
    base = settled(pre, "K7 before")
    _, stream = _prefill(pre, "k7")
    session = _session(stream)
    response = pre.unary("Abort", oe.AbortRequest(kv_session=session))
    expect(response.status == oe.ABORT_STATUS_ABORTED, f"Abort(kv_session) status {response.status}")
    code, _ = pre.unary_code("Abort", oe.AbortRequest(kv_session=session))
    expect(code == grpc.StatusCode.NOT_FOUND, f"a released session aborted again: {code.name}, want NOT_FOUND")
    pre.wait_idle("K7: after Abort(kv_session)", baseline=base.used_kv_blocks)
    return "released, then NOT_FOUND"


@check("K7", "a finished prefill → decode hand-over releases the KV of both servers")
def finish_releases_both(t: Target) -> str:
    """K7 (finish): after a session is decoded to its end, both servers are back to the KV they
    used before it (found by review: only Abort(kv_session) was judged, so a DECODE server
    keeping KV after every finished decode passed). Needs GetLoad on both (optional: else skip)."""
    pre, dec = _pair(t)
    if not (pre.has_load and dec.has_load):
        skip("needs GetLoad on the PREFILL and DECODE servers to see their KV")
    before = settled(pre, "K7 finish: prefill before"), settled(dec, "K7 finish: decode before")
    req, stream = _prefill(pre, "k7f")
    out = _decode(dec, req, _session(stream))
    if not (out.ok and out.finished() is not None and not out.of("error")):
        skip(f"the decode did not finish ({out.describe()}): K9 judges the decode stream")
    for server, base, what in ((pre, before[0], "PREFILL"), (dec, before[1], "DECODE")):
        load = server.wait_until(functools.partial(_back_to, base.used_kv_blocks))
        expect(_back_to(base.used_kv_blocks, load),
               f"the {what} server holds {load.used_kv_blocks} KV blocks after a finished hand-over, "
               f"{base.used_kv_blocks} before it (running {load.running_requests}, queued {load.queued_requests})")
    return "both servers back to their KV after the decode finished"


def _back_to(used_kv_blocks: int, load: Any) -> bool:
    return load.running_requests == 0 and load.queued_requests == 0 and load.used_kv_blocks <= used_kv_blocks


@check("K8", "decoding a released session ends with one not-retryable KV error, then OK")
def decode_of_a_released_session_fails(t: Target) -> str:
    """K8 judges an accepted decode; a DECODE server that finds the session gone while validating
    it (K5) may refuse it before acceptance instead (X1: a status, no event; found by review: that
    failed K8)."""
    pre, dec = _pair(t)
    req, stream = _prefill(pre, "k8")
    session = _session(stream)
    pre.unary("Abort", oe.AbortRequest(kv_session=session))
    out = _decode(dec, req, session)
    if not out.ok and not out.events:  # what K5's validation may answer; INTERNAL or a hang is no refusal
        expect(out.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
                            grpc.StatusCode.INVALID_ARGUMENT), f"a released session refused with {out.code.name} "
               f"({out.details!r}): before acceptance NOT_FOUND, FAILED_PRECONDITION or INVALID_ARGUMENT")
        return f"refused before acceptance with {out.code.name}"
    errors = out.of("error")
    expect(out.ok and len(errors) == 1 and out.events[-1].HasField("error"),
           f"want exactly one terminal EngineError then OK: {out.describe()}")
    expect(errors[0].code in (oe.ERROR_CODE_KV_SESSION_NOT_FOUND, oe.ERROR_CODE_KV_TRANSFER_FAILED),
           f"error code {enum_name(oe.ErrorCode, errors[0].code)}")
    expect(not errors[0].retryable, "X3: the unchanged request cannot succeed once its session is gone")
    dec.wait_idle()
    return enum_name(oe.ErrorCode, errors[0].code)


@check("K10", "greedy prefill → decode output equals the AGGREGATED target's")
def disaggregated_equals_aggregated(t: Target) -> str:
    pre, dec = _pair(t)
    if t.server_info.engine_role != oe.ENGINE_ROLE_AGGREGATED:
        skip("the target is not AGGREGATED: nothing to compare the pair with")
    req, stream = _prefill(pre, "k10")
    out = _decode(dec, req, _session(stream))
    want = t.generate(t.request("k10-agg", max_tokens=8))
    models = {name: server.model_info.model_id for name, server in (("target", t), ("--prefill", pre),
                                                                     ("--decode", dec))}
    if out.tokens() != want.tokens() and len(set(models.values())) > 1:  # found by review
        skip(f"the outputs differ, and the servers name different models {models}: not comparable")
    expect(out.tokens() == want.tokens(), f"disaggregated {out.tokens()} != aggregated {want.tokens()}")
    return f"{len(want.tokens())} tokens equal"
