"""Waiting for a server's channel, and saying why it never became ready.

``grpc.channel_ready_future`` only times out: a closed port, a host that does not resolve and an
HTTP/1 server on the port all read "cannot connect within 10 s" (found by review). After the
wait, one call that does not wait for readiness fails at once with the transport's last error,
in gRPC's own words ("Connection refused", "Trying to connect an http1.x server"). The call names
a method no server has: a gRPC server that just became ready answers UNIMPLEMENTED and runs
nothing.
"""

from __future__ import annotations

import grpc

#: The probe's method: in no service, so an answering server runs nothing for it.
PROBE_METHOD = "/refengine.reachability.v1.Probe/Reachable"
#: How long the probe may take: it fails at once unless the server answers.
PROBE_TIMEOUT_S = 2.0


def not_ready_reason(channel: grpc.Channel, timeout_s: float) -> str:
    """"" once ``channel`` is ready within ``timeout_s``; else why not (gRPC's last transport
    error, or that nothing answered)."""
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
        return ""
    except grpc.FutureTimeoutError:
        pass
    probe = channel.unary_unary(PROBE_METHOD, request_serializer=bytes, response_deserializer=bytes)
    try:
        probe(b"", timeout=PROBE_TIMEOUT_S, wait_for_ready=False)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            return exc.details() or "unavailable"
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return "no answer (a firewall dropping the packets, or a server that accepts and never replies?)"
    return ""  # it answered (UNIMPLEMENTED, most likely): ready after all
