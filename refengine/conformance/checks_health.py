"""Section H — Health and GetLoad (H1–H4).

The release's HealthState is UNSPECIFIED, STARTING, READY, DEGRADED, NOT_READY (= 4).
There is no DRAINING state: NOT_READY means "cannot accept new work", whatever the
cause (not serving, shutting down, draining), and NOT_READY is the worst state."""

from __future__ import annotations

import time
from typing import Any

import grpc

from refengine.conformance.assertions import expect_valid, settled
from refengine.conformance.registry import check, expect, skip
from refengine.conformance.release import PRE_RELEASE_VALUES, RELEASE
from refengine.conformance.streams import Background
from refengine.conformance.target import Target
from refengine.protocol import oe

READY, DEGRADED = oe.HEALTH_STATE_READY, oe.HEALTH_STATE_DEGRADED
NOT_READY = oe.HEALTH_STATE_NOT_READY


def _name(state: int) -> str:
    return oe.HealthState.Name(state) if state in oe.HealthState.values() else str(state)


def _health(t: Target, probe: bool = False, **kw: Any) -> Any:
    return t.unary("Health", oe.HealthRequest(include_inference_probe=probe, **kw))


def _consistent(resp: Any, what: str) -> None:
    """H1: overall = worst check: READY only if every check is READY, NOT_READY if any
    check is NOT_READY, and the overall state is one of the checks' states."""
    expect(resp.state != oe.HEALTH_STATE_UNSPECIFIED, f"{what}: overall state UNSPECIFIED")
    states = [c.state for c in resp.checks]
    desc = f"{what}: overall {_name(resp.state)}, checks {[(c.name, _name(c.state)) for c in resp.checks]}"
    if not states:
        return
    expect(all(c.name for c in resp.checks), f"{desc}: a check has no name")
    expect(resp.state in states, f"{desc}: the overall state is none of the checks' states")
    if any(s != READY for s in states):
        expect(resp.state != READY, f"{desc}: READY although a check is not")
    if NOT_READY in states:
        expect(resp.state == NOT_READY, f"{desc}: a check is NOT_READY but overall is not")


@check("H1", "Health state is consistent with its checks (overall = worst check)")
def health_consistent(t: Target) -> str:
    """H1: with and without the inference probe."""
    plain = _health(t)
    _consistent(plain, "Health()")
    probed = _health(t, probe=True)
    _consistent(probed, "Health(probe)")
    return f"{_name(plain.state)} with {len(plain.checks)} checks; probe: {_name(probed.state)}"


@check("H2", "include_inference_probe runs a bounded probe; concurrent probes are safe")
def inference_probe(t: Target) -> str:
    """H2: the probe returns promptly and concurrent probes all succeed. How a probe is
    reported is not in the release: whether one is seen in the checks (an added check, or
    one naming it) is said, not judged."""
    plain = _health(t)
    start = time.monotonic()
    probed = _health(t, probe=True)
    took = time.monotonic() - start
    expect(probed.state in (READY, DEGRADED), f"a serving engine's probe reports {_name(probed.state)}")
    seen = len(probed.checks) > len(plain.checks) or any(
        word in c.name.lower() for c in probed.checks for word in ("probe", "inference"))
    expect(took < t.options.rpc_timeout_s, f"probe took {took:.1f} s")
    calls = [Background(lambda: _health(t, probe=True)) for _ in range(6)]
    calls += [Background(lambda: t.generate(t.request("h2", max_tokens=3))) for _ in range(2)]
    results = [c.join() for c in calls]
    for resp in results[:6]:
        expect(resp.state in (READY, DEGRADED), f"a concurrent probe reported {_name(resp.state)}")
    for res in results[6:]:
        expect_valid(res, what="Generate next to concurrent probes")
    t.wait_idle("H2: after probes")
    shown = "a probe check is shown" if seen else "no check shows the probe (its reporting is the server's choice)"
    return f"probe {took * 1000:.0f} ms, {shown}; 6 concurrent probes + 2 requests fine"


@check("H2", "the probe on each named PREFILL/DECODE server answers and leaves nothing held")
def probe_on_named_roles(t: Target) -> str:
    """H2 on the ``--prefill``/``--decode`` servers of the run (skips without them): three
    concurrent probes each answer READY or DEGRADED in time, and afterwards the server holds no
    more KV sessions or blocks than before. A PREFILL server's role-appropriate probe may prefill
    into a session; nobody pulls it, so the server must release it (a router that probes every
    second would otherwise keep one session, with its blocks, per probe for a whole lease).
    That a DECODE server's probe reports DEGRADED for want of a session, a client cannot tell
    from a real degradation: the check says what it got."""
    named = [(name, address) for name, address in (("--prefill", t.options.prefill_address),
                                                    ("--decode", t.options.decode_address)) if address]
    if not named:
        skip("no --prefill or --decode server is named")
    found = []
    for name, address in named:
        peer = t.connect_peer(address, name)
        code, before = peer.unary_code("GetLoad", oe.GetLoadRequest())
        calls = [Background(lambda peer=peer: _health(peer, probe=True)) for _ in range(3)]
        states = [c.join().state for c in calls]
        expect(all(s in (READY, DEGRADED) for s in states),
               f"{name}: a serving server's probes reported {[_name(s) for s in states]}")
        if code != grpc.StatusCode.OK:  # no load figures: what the probes leave cannot be seen
            found.append(f"{name}: {[_name(s) for s in states]} (GetLoad {code.name}: holdings not checked)")
            continue
        load = peer.wait_idle(f"H2: {name} after three probes")
        if not (load.HasField("active_kv_sessions") and before.HasField("active_kv_sessions")):
            found.append(f"{name}: {[_name(s) for s in states]} (GetLoad has no active_kv_sessions: not checked)")
            continue
        expect(load.active_kv_sessions <= before.active_kv_sessions,
               f"{name}: {load.active_kv_sessions} KV sessions held after three probes, {before.active_kv_sessions} "
               "before: a probe's session must be released, nobody pulls it")
        found.append(f"{name}: {[_name(s) for s in states]}, nothing held afterwards")
    return "; ".join(found)


def _unknown_states(resp: Any) -> list[str]:
    """Every state in ``resp`` (overall and per check) that the release does not define."""
    states = [("overall", resp.state)] + [(f"check {c.name!r}", c.state) for c in resp.checks]
    known = set(oe.HealthState.values())
    return [f"{where} = {state}" + (f" ({PRE_RELEASE_VALUES[('openengine.v1.HealthState', state)]})"
                                   if ("openengine.v1.HealthState", state) in PRE_RELEASE_VALUES else "")
            for where, state in states if state not in known]


@check("H3", "a serving engine reports READY (or DEGRADED), never STARTING / NOT_READY; only release states")
def serving_state(t: Target) -> str:
    """H3 (as far as a client can see): while Generate works, Health is READY or DEGRADED,
    not STARTING or NOT_READY, and no state outside the release is sent (nothing above
    NOT_READY = 4; the release has no DRAINING).

    STARTING before readiness and NOT_READY while draining need control over the
    server's lifecycle, which a client lacks (the launcher sees startup:
    tests/conformance/test_conformance.py::test_startup_states)."""
    expect_valid(t.generate(t.request("h3", max_tokens=1)))
    resp = _health(t)
    busy = t.generate_async(t.request("h3", max_tokens=16, ignore_eos=True))
    during = _health(t)
    probed = _health(t, probe=True)
    busy.join()
    for what, r in (("Health()", resp), ("Health() while serving", during), ("Health(probe)", probed)):
        unknown = _unknown_states(r)
        expect(not unknown, f"{what}: states outside {RELEASE}: {', '.join(unknown)}")
    expect(resp.state in (READY, DEGRADED), f"Generate works but Health says {_name(resp.state)}")
    expect(during.state in (READY, DEGRADED), f"while serving a request Health says {_name(during.state)}")
    return f"{_name(resp.state)} while serving"


def _load_sane(load: Any, what: str) -> None:
    if load.HasField("used_kv_blocks") and load.HasField("total_kv_blocks"):
        expect(load.used_kv_blocks <= load.total_kv_blocks,
               f"{what}: used_kv_blocks {load.used_kv_blocks} > total_kv_blocks {load.total_kv_blocks}")
    for rank in load.ranks:
        if rank.HasField("used_kv_blocks") and rank.HasField("total_kv_blocks"):
            expect(rank.used_kv_blocks <= rank.total_kv_blocks,
                   f"{what}: rank {rank.data_parallel_rank} used {rank.used_kv_blocks} > total")


@check("H4", "GetLoad: counts rise while requests run, used ≤ total, per-rank rows, back to idle after")
def load_counts(t: Target) -> str:
    """H4: running/queued counts and KV blocks follow the work, then return to where they were
    before it (blocks an earlier check left behind are that check's finding)."""
    idle = settled(t, "H4 before")
    expect(idle.HasField("running_requests") and idle.HasField("queued_requests"),
           "GetLoad does not report running_requests / queued_requests")
    _load_sane(idle, "idle")
    per_rank = t.load(per_rank=True)
    dp = t.server_info.parallelism
    expected_rows = dp.data_parallel_size if dp.HasField("data_parallel_size") else None
    expect(len(per_rank.ranks) >= 1, "include_per_rank returned no RankLoadInfo row")
    if expected_rows:
        expect(len(per_rank.ranks) == expected_rows,
               f"{len(per_rank.ranks)} per-rank rows, data_parallel_size {expected_rows}")
    # Long requests, aborted once seen (found by review: 40-token ones ended between two polls on
    # a server doing 1,000 tokens/s, and a conforming server failed).
    requests = [t.long_request("h4") for _ in range(3)]
    calls = [t.generate_async(req) for req in requests]
    busy = t.wait_until(lambda lo: lo.running_requests + lo.queued_requests >= 3, timeout=5)
    busy_rank = t.load(per_rank=True)
    for req in requests:
        t.abort(req.request_id)
    results = [c.join() for c in calls]
    for res in results:
        expect_valid(res, what="H4 load request")
    if busy.running_requests + busy.queued_requests < 3 and any(
            f.reason != oe.FINISH_REASON_CANCELLED for res in results for f in res.of("finished")):
        skip(f"3 requests of {requests[0].stopping.max_tokens} tokens ended before GetLoad (polled every 50 ms) "
             f"saw them all (running={busy.running_requests} queued={busy.queued_requests}): too fast to observe")
    expect(busy.running_requests + busy.queued_requests >= 3,
           f"3 requests in flight but running={busy.running_requests} queued={busy.queued_requests}")
    _load_sane(busy, "busy")
    _load_sane(busy_rank, "busy per rank")
    if busy.HasField("used_kv_blocks"):
        expect(busy.used_kv_blocks > idle.used_kv_blocks,
               f"3 running requests but used_kv_blocks {busy.used_kv_blocks} (idle {idle.used_kv_blocks})")
    if busy_rank.ranks and busy_rank.ranks[0].HasField("running_requests"):
        total = sum(r.running_requests + r.queued_requests for r in busy_rank.ranks)
        expect(total >= 1, f"per-rank rows show no work while 3 requests run: {busy_rank.ranks}")
    after = t.wait_idle("H4: after all requests ended", baseline=idle.used_kv_blocks)
    _load_sane(after, "after")
    _rank_rows_idle(t, per_rank, "after all requests ended")
    return (f"idle run/queue/used {idle.running_requests}/{idle.queued_requests}/{idle.used_kv_blocks}, busy "
            f"{busy.running_requests}/{busy.queued_requests}/{busy.used_kv_blocks}, back to idle")



def _scalars(msg: Any) -> tuple[list[str], list[str]]:
    """(present, absent) optional scalar fields of ``msg``."""
    names = [fd.name for fd in msg.DESCRIPTOR.fields if fd.message_type is None and fd.has_presence]
    return [n for n in names if msg.HasField(n)], [n for n in names if not msg.HasField(n)]


def _both(msg: Any, a: str, b: str) -> bool:
    return msg.HasField(a) and msg.HasField(b)


def _measurement_problems(row: Any, what: str) -> list[str]:
    """H4: a present load scalar is a measurement, so it must be one a live engine can have.
    (A 0 that is really "not filled in" shows up as an impossible value here.)"""
    problems = []
    if row.HasField("total_kv_blocks") and row.total_kv_blocks == 0:
        problems.append(f"{what}: total_kv_blocks present as 0; a serving engine has KV blocks (absent = "
                        "unavailable, so a 0 here is a default, not a measurement)")
    if _both(row, "used_kv_blocks", "total_kv_blocks") and row.used_kv_blocks > row.total_kv_blocks:
        problems.append(f"{what}: used_kv_blocks {row.used_kv_blocks} > total_kv_blocks {row.total_kv_blocks}")
    if "running_tokens" in row.DESCRIPTOR.fields_by_name and _both(row, "running_tokens", "running_requests"):
        if (row.running_requests > 0) != (row.running_tokens > 0):
            problems.append(f"{what}: running_requests {row.running_requests} but running_tokens "
                            f"{row.running_tokens} (running requests hold tokens, and only they do)")
    return problems


MAX_CLOCK_SKEW_S = 24 * 3600.0  # generous: the server may be remote; a default 0 is ~56 years off


def _load_problems(load: Any, what: str) -> list[str]:
    problems = _measurement_problems(load, what)
    if load.HasField("timestamp_unix_nanos"):
        skew = abs(load.timestamp_unix_nanos / 1e9 - time.time())
        if skew > MAX_CLOCK_SKEW_S:
            problems.append(f"{what}: timestamp_unix_nanos {load.timestamp_unix_nanos} is {skew / 86400:.0f} days "
                            "from the client's clock, not a sample time")
    for rank in load.ranks:
        label = f"{what} rank {rank.data_parallel_rank if rank.HasField('data_parallel_rank') else '?'}"
        if not rank.HasField("data_parallel_rank"):
            problems.append(f"{label}: a RankLoadInfo row without data_parallel_rank cannot be attributed")
        problems.extend(_measurement_problems(rank, label))
    return problems


def _rank_rows_idle(t: Target, before: Any, what: str) -> None:
    """H4: once idle, every per-rank row is idle too: no running or queued request, no more KV than
    its row held before the work (found by review: only the top-level counts were asked to come
    back, so rows counting every request ever admitted passed). Rows refreshed later than the
    top-level counts are polled until the idle timeout."""
    held = {row.data_parallel_rank: row.used_kv_blocks for row in before.ranks if row.HasField("used_kv_blocks")}
    deadline = time.monotonic() + t.options.idle_timeout_s
    while (problems := _busy_rows(t.load(per_rank=True).ranks, held)) and time.monotonic() < deadline:
        time.sleep(0.05)
    expect(not problems, f"{what}: " + "; ".join(problems))


def _busy_rows(rows: Any, held: dict[int, int]) -> list[str]:
    problems = []
    for row in rows:
        rank = row.data_parallel_rank
        busy = [f"{name} {getattr(row, name)}" for name in ("running_requests", "queued_requests")
                if row.HasField(name) and getattr(row, name)]
        if busy:
            problems.append(f"rank {rank}'s row still says {', '.join(busy)}")
        if row.HasField("used_kv_blocks") and rank in held and row.used_kv_blocks > held[rank]:
            problems.append(f"rank {rank}'s row holds {row.used_kv_blocks} KV blocks, {held[rank]} before the work")
    return problems


@check("H4", "GetLoad scalars use presence: absent = unavailable; every present value is a real measurement")
def load_presence(t: Target) -> str:
    """H4: sampled before, while a request runs and after, with per-rank rows; reports which load
    scalars the server measures (present) and which it cannot (absent)."""
    base = settled(t, "H4 presence before")
    before = t.load(per_rank=True)
    req = t.long_request("h4p")
    busy_call = t.generate_async(req)
    busy = t.wait_until(lambda lo: lo.running_requests > 0, timeout=5)
    busy = t.load(per_rank=True) if busy.running_requests > 0 else busy
    t.abort(req.request_id)
    busy_call.join()
    after = t.wait_idle("H4 presence", baseline=base.used_kv_blocks)
    problems = _load_problems(before, "before") + _load_problems(busy, "busy") + _load_problems(after, "after")
    expect(not problems, "; ".join(problems[:4]))
    present, absent = _scalars(busy)
    rows = f"; rank rows: {', '.join(_scalars(busy.ranks[0])[0]) or 'none'} present" if busy.ranks else ""
    return f"present: {', '.join(present) or 'none'}; absent: {', '.join(absent) or 'none'}{rows}"
