"""Section E — KV events, E5 and E6: how a subscription fails, and where the event sources are.

E5: a failure after ``SubscribeKvEvents`` was accepted is one final ``EngineError`` event, then
status OK, never a bare status; two failures any client can cause are checked: a replay point
beyond the newest batch, and one no longer retained (after ``Options.replay_budget_batches``
batches were published). E6: ``GetKvEventSources`` never advertises a wildcard host, and a
TCP endpoint it lists accepts a connection from where the suite runs: refused by a loopback
address or by the host the suite reached the target at, nothing listens there (a failure);
refused elsewhere (a firewall may have answered), unreachable or unresolvable, it cannot be
judged from here and is said in the result. It answers one source per requested rank (a server
with no compatibility publisher lists none at all: E6 is then not claimed), and refuses unknown
or repeated ranks with INVALID_ARGUMENT.
"""

from __future__ import annotations

import socket
from typing import Any

import grpc

from refengine.conformance.enums import enum_name
from refengine.conformance.hosts import bare_host, is_same_machine, is_wildcard_host
from refengine.conformance.kv_subscriber import (
    _need_text,
    expired_replay,
    latest_number,
    subscribe,
    terminal_error,
)
from refengine.conformance.registry import check, expect, not_claimed, skip
from refengine.conformance.target import Target
from refengine.protocol import oe

CONNECT_TIMEOUT_S = 3.0


# -- E5 ------------------------------------------------------------------------------------
@check("E5", "a failure after acceptance (replay point not retained) is one final error event, then OK")
def failure_is_error_then_ok(t: Target) -> str:
    """E5: a replay from a number far beyond the newest batch cannot be served (not retained):
    exactly one EngineError, nothing after it, status OK."""
    _need_text(t)
    start = latest_number(t) + 1000
    sub = subscribe(t, start=start)
    try:
        if not sub.wait_responses(1, 3.0) and not sub.ended:
            skip(f"replay from {start} (beyond the newest batch) waits instead of failing: no failure to observe")
        error = terminal_error(sub, f"replay from {start}, beyond the newest batch")
    finally:
        sub.close()
    return f"{enum_name(oe.ErrorCode, error.code)} (retryable={error.retryable}) {error.message!r}, then OK"


@check("E5", "a replay from a number no longer retained is one final error event, then OK")
def expired_replay_is_error_event(t: Target) -> str:
    """E5: once ``Options.replay_budget_batches`` batches were published, a replay from batch 1
    (gone from any retention window shorter than that) ends with exactly one EngineError, then
    OK, not with a bare status. Skips while batch 1 is still retained; a replay that starts
    later without an error is E1's finding (skip here)."""
    sub, newest = expired_replay(t, "e5x")
    try:
        first = sub.responses[0] if sub.responses else None
        if first is not None and first.WhichOneof("event") == "batch":
            skip(f"replay from 1 (newest {newest}) began with batch {first.batch.sequence_number}: still retained, "
                 "or skipped silently (E1 judges that)")
        error = terminal_error(sub, f"replay from expired sequence number 1 (newest {newest})")
    finally:
        sub.close()
    return f"replay from 1 (newest {newest}): {enum_name(oe.ErrorCode, error.code)} {error.message!r}, then OK"


# -- E6 ------------------------------------------------------------------------------------
def _sources(t: Target, ranks: list[int]) -> tuple[grpc.StatusCode, Any]:
    return t.unary_code("GetKvEventSources", oe.GetKvEventSourcesRequest(data_parallel_ranks=ranks))


def _ranks(t: Target) -> tuple[int, int]:
    """(first rank, number of ranks) as ServerInfo.parallelism reports them (0, 1 when absent)."""
    p = t.server_info.parallelism
    first = p.data_parallel_start_rank if p.HasField("data_parallel_start_rank") else 0
    size = p.data_parallel_size if p.HasField("data_parallel_size") and p.data_parallel_size > 0 else 1
    return first, size


def _source_problems(sources: Any) -> list[str]:
    problems = []
    for s in sources:
        host = s.endpoint_addr.host
        if is_wildcard_host(host):
            problems.append(f"source for rank {s.data_parallel_rank} advertises wildcard host {host!r}")
        if not 0 < s.endpoint_addr.port < 65536:
            problems.append(f"source for rank {s.data_parallel_rank} has port {s.endpoint_addr.port}")
    return problems


def _probe(endpoint: Any) -> str | None:
    """Connect to a TCP ``endpoint`` and close: None when it accepted, "refused" when the
    connection was refused, else why it could not be made."""
    try:
        with socket.create_connection((bare_host(endpoint.host), endpoint.port), timeout=CONNECT_TIMEOUT_S):
            return None
    except ConnectionRefusedError:
        return "refused"
    except OSError as err:
        return f"{type(err).__name__}: {err}"


def _connectable(sources: Any, target_host: str) -> tuple[list[str], list[str]]:
    """(problems, notes): every TCP source listed (a well-formed one) is dialled once."""
    problems, notes = [], []
    for s in sources:
        endpoint = s.endpoint_addr
        if endpoint.protocol not in ("", "tcp") or _source_problems([s]):
            continue
        where = f"{endpoint.host}:{endpoint.port}"
        outcome = _probe(endpoint)
        # a refusal from elsewhere may be a firewall's on the way, not the source's
        if outcome == "refused" and is_same_machine(endpoint.host, target_host):
            problems.append(f"source for rank {s.data_parallel_rank} at {where}: connection refused (nothing "
                            "listens there)")
        elif outcome is not None:
            notes.append(f"{where} not reachable from here ({outcome})")
    return problems, notes


@check("E6", "GetKvEventSources: one connectable source per requested rank, bad ranks refused")
def kv_event_sources(t: Target) -> str:
    """E6: every endpoint is connectable (a concrete host, a port, and a TCP one accepts a
    connection); all ranks give one source each, one rank gives exactly its own; an unknown rank
    and a rank named twice are INVALID_ARGUMENT. A server listing no source at all has no
    compatibility publisher (ref: none configured): not claimed, not a pass (found by review:
    "one source or none" passed a server answering nothing to every request)."""
    code, every = _sources(t, [])
    if code == grpc.StatusCode.UNIMPLEMENTED:
        not_claimed("GetKvEventSources is UNIMPLEMENTED")
    expect(code == grpc.StatusCode.OK, f"GetKvEventSources() returned {code.name}")
    first, size = _ranks(t)
    for what, ranks in (("an unknown rank", [first + size]), ("a rank named twice", [first, first])):
        code, _ = _sources(t, ranks)
        expect(code == grpc.StatusCode.INVALID_ARGUMENT,
               f"GetKvEventSources({ranks}) ({what}) returned {code.name}; expected INVALID_ARGUMENT")
    refused = f"ranks [{first + size}] and [{first}, {first}] refused"
    code, one = _sources(t, [first])
    expect(code == grpc.StatusCode.OK, f"GetKvEventSources([{first}]) returned {code.name}")
    if not every.sources and not one.sources:
        not_claimed(f"GetKvEventSources lists no source, for all ranks or rank {first}: no event publisher to "
                    f"describe ({refused})")
    _one_per_rank(every.sources, one.sources, first, size)
    problems = _source_problems(every.sources) + _source_problems(one.sources)
    expect(not problems, "; ".join(problems))
    problems, notes = _connectable(every.sources, t.address.rsplit(":", 1)[0])
    expect(not problems, "; ".join(problems))
    dialled = f"; {len(every.sources) - len(notes)} accepted a connection"
    unjudged = f" ({'; '.join(notes)})" if notes else ""
    return f"{len(every.sources)} source(s), one per rank{dialled}{unjudged}; {refused}"


def _one_per_rank(every: Any, one: Any, first: int, size: int) -> None:
    """E6: asked for all ranks, one source for each of ``first`` … ``first + size - 1``; asked
    for ``first``, exactly one, its own. A source without ``data_parallel_rank`` is the first
    rank's where there is only one."""
    def rank(s: Any) -> int:
        return s.data_parallel_rank if s.HasField("data_parallel_rank") or size > 1 else first
    listed = sorted(rank(s) for s in every)
    expect(listed == list(range(first, first + size)), f"GetKvEventSources() listed sources for ranks {listed}; "
                                                       f"want one for each of ranks {first}..{first + size - 1}")
    expect(len(one) == 1 and rank(one[0]) == first,
           f"GetKvEventSources([{first}]) returned sources for ranks {[rank(s) for s in one]}; want one, rank {first}")
