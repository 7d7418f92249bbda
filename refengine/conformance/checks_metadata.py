"""Section M — request metadata (gRPC headers)."""

from __future__ import annotations

import grpc

from refengine.conformance.assertions import NON_OK, expect_rejected, expect_valid
from refengine.conformance.registry import check, expect, skip
from refengine.conformance.target import Target
from refengine.protocol import oe

TRACEPARENT = ("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
TRACESTATE = ("tracestate", "oeconf=1,congo=t61rcWkgMzE")


@check("M1", "well-formed openengine-* and trace keys are accepted")
def well_formed_keys(t: Target) -> str:
    """M1: each defined key with a valid value is accepted on Generate."""
    cases = [
        [("openengine-routing-key", "tenant-a/session-42")],
        [("openengine-target-dp-rank", "0")],
        [("openengine-priority", "0")],
        [("openengine-priority", "-7")],
        [("openengine-priority", "2147483647")],
        [TRACEPARENT, TRACESTATE],
        [("openengine-routing-key", "k"), ("openengine-priority", "3"), ("x-app-header", "anything")],
    ]
    for md in cases:
        expect_valid(t.generate(t.request("m1", max_tokens=1), metadata=md), what=f"metadata {md}")
    return f"{len(cases)} metadata combinations accepted"


MALFORMED = [
    ("openengine-target-dp-rank", "abc"),
    ("openengine-target-dp-rank", "-1"),
    ("openengine-target-dp-rank", "4294967296"),
    ("openengine-target-dp-rank", "1.5"),
    ("openengine-target-dp-rank", ""),
    ("openengine-target-dp-rank", "0x1"),
    ("openengine-target-dp-rank", "0_0"),  # Python's int() takes these three (found by review)
    ("openengine-priority", "1_000"),
    ("openengine-priority", "+7"),
    ("openengine-priority", "high"),
    ("openengine-priority", "2147483648"),
    ("openengine-priority", "-2147483649"),
    ("openengine-priority", "1e3"),
    ("openengine-priority", ""),
    ("openengine-routing-key", ""),
]

REPEATED = [
    [("openengine-routing-key", "a"), ("openengine-routing-key", "b")],
    [("openengine-priority", "1"), ("openengine-priority", "1")],
    [("openengine-target-dp-rank", "0"), ("openengine-target-dp-rank", "0")],
]


@check("M2", "malformed numeric values and empty routing keys → INVALID_ARGUMENT, no events")
def malformed_values(t: Target) -> str:
    """M2: a malformed numeric value or an empty routing key is INVALID_ARGUMENT."""
    for key, value in MALFORMED:
        res = t.generate(t.request("m2", max_tokens=1), metadata=[(key, value)])
        expect_rejected(res, what=f"{key}: {value!r}")
    return f"{len(MALFORMED)} malformed values refused"


@check("M2", "a repeated openengine-* key → INVALID_ARGUMENT, no events")
def repeated_keys(t: Target) -> str:
    """M2: each openengine-* key may appear at most once."""
    for md in REPEATED:
        expect_rejected(t.generate(t.request("m2r", max_tokens=1), metadata=md), what=f"repeated {md[0][0]}")
    return f"{len(REPEATED)} repeated keys refused"


@check("M3", "kv.session dp_rank disagreeing with openengine-target-dp-rank → INVALID_ARGUMENT")
def session_rank_conflict(t: Target) -> str:
    """M3: session.dp_rank is authoritative; a disagreeing target-dp-rank is INVALID_ARGUMENT.

    On a non-DECODE engine the session itself is also a role mismatch (D7/K6), so any
    refusal before acceptance is accepted there; on DECODE it must be INVALID_ARGUMENT."""
    req = t.request("m3", max_tokens=1)
    req.kv.session.session_id = "oeconf-session"
    req.kv.session.transfer_backend = "grpc"
    req.kv.session.endpoints.add(host="127.0.0.1", port=1, protocol="grpc")
    req.kv.session.dp_rank = 0
    res = t.generate(req, metadata=[("openengine-target-dp-rank", "1")])
    decode = t.server_info.engine_role == oe.ENGINE_ROLE_DECODE
    expect_rejected(res, codes=(grpc.StatusCode.INVALID_ARGUMENT,) if decode else NON_OK,
                    what="session dp_rank 0 with target-dp-rank 1")
    return f"refused with {res.code.name}" + ("" if decode else " (non-DECODE engine: role mismatch also applies)")


@check("M4", "openengine-priority: accepted; honoured by admission order when advertised")
def priority(t: Target) -> str:
    """M4: priority is honoured only when supports_priority is advertised.

    When the deployment's max_running_requests is small enough, fill every running
    slot, queue a low then a high priority request, free one slot: the high
    priority request must produce its first token first."""
    advertised = t.caps.HasField("supports_priority") and t.caps.supports_priority
    expect_valid(t.generate(t.request("m4", max_tokens=1), metadata=[("openengine-priority", "5")]),
                 what="request with openengine-priority")
    if not advertised:
        return "supports_priority not advertised: the key is accepted (and may be ignored)"
    cap = t.server_info.capacity
    if not cap.HasField("max_running_requests") or cap.max_running_requests > 8:
        skip("accepted, but admission order cannot be observed: max_running_requests "
             f"{cap.max_running_requests if cap.HasField('max_running_requests') else 'unreported'}, the check "
             "fills at most 8 running slots (run it against a deployment limited to 8 or fewer)")
    t.need_load("admission order (filling every running slot)")
    slots = cap.max_running_requests
    fillers = [t.long_request("m4fill") for _ in range(slots)]
    calls = [t.generate_async(r) for r in fillers]
    try:
        load = t.wait_until(lambda lo: lo.running_requests >= slots, timeout=10)
        expect(load.running_requests >= slots, f"could not fill {slots} running slots ({load.running_requests})")
        low = t.request("m4low", max_tokens=2)
        high = t.request("m4high", max_tokens=2)
        low_call = t.generate_async(low, metadata=[("openengine-priority", "-10")])
        t.wait_until(lambda lo: lo.queued_requests >= 1, timeout=5)
        high_call = t.generate_async(high, metadata=[("openengine-priority", "10")])
        # A scheduler that preempts for priority may start the high one at once: also fine.
        t.wait_until(lambda lo: lo.queued_requests >= 2, timeout=3)
        t.abort(fillers[0].request_id)
        low_res, high_res = low_call.join(), high_call.join()  # both end once the slot frees
    finally:
        for r in fillers:
            t.abort(r.request_id)
        for c in calls:
            c.join()
    expect_valid(low_res, what="low priority request")
    expect_valid(high_res, what="high priority request")
    expect(high_res.times[0] < low_res.times[0],
           f"low priority request (-10) got its first event {1000 * (high_res.times[0] - low_res.times[0]):.0f} "
           "ms before the high priority one (10), queued later")
    t.wait_idle("M4")
    return f"high priority admitted first with {slots} running slots"


CONTROL_CALLS = [
    ("GetServerInfo", oe.GetServerInfoRequest()),
    ("GetLoad", oe.GetLoadRequest()),
    ("Health", oe.HealthRequest()),
]


@check("M5", "traceparent / tracestate accepted on every RPC")
def trace_context(t: Target) -> str:
    """M5: trace context is accepted on every RPC (propagation needs downstream RPCs: KV transfer)."""
    md = [TRACEPARENT, TRACESTATE]
    for method, request in CONTROL_CALLS + [("GetModelInfo", oe.GetModelInfoRequest(model=t.model))]:
        code, _ = t.unary_code(method, request, metadata=md)
        # GetLoad is optional: a target without it answers the same with and without trace context.
        wanted = t.load_code if method == "GetLoad" else grpc.StatusCode.OK
        expect(code == wanted, f"{method} with trace context returned {code.name}, without it {wanted.name}")
    plain, _ = t.unary_code("Abort", oe.AbortRequest(request_id="oeconf-unknown"))
    traced, _ = t.unary_code("Abort", oe.AbortRequest(request_id="oeconf-unknown"), metadata=md)
    expect(plain == traced, f"Abort(unknown) returned {plain.name} without and {traced.name} with trace context")
    plain, _ = t.unary_code("ListLoras", oe.ListLorasRequest())
    traced, _ = t.unary_code("ListLoras", oe.ListLorasRequest(), metadata=md)
    expect(plain == traced, f"ListLoras returned {plain.name} without and {traced.name} with trace context")
    expect_valid(t.generate(t.request("m5", max_tokens=1), metadata=md), what="Generate with trace context")
    return "accepted on Control and Inference RPCs; propagation not observable without KV transfer"
