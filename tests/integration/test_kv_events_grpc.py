"""KV events over gRPC against a server of this module's own (RULES E1–E6, ref choices in
``refengine/server/kv_events_service.py``).

The server has a small KV pool (24 blocks of 16 tokens: Generate requests evict each
other's blocks), keeps 50 batches for replay, lets a subscriber hold 16 unread batches and
disconnects a stream that stops reading for 2 s.
"""

from __future__ import annotations

import signal
import statistics
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from refengine.client import OpenEngineClient
from refengine.conformance.kv_subscriber import KvSubscriber, KvView
from refengine.protocol import oe
from tests.integration.conftest import ServerProcess, greedy_request, running_server

RETAINED = 50
STALL_S = 2.0
SERVER_ARGS = ("--num-kv-blocks", "24", "--max-model-len", "512", "--max-num-seqs", "8",
               "--kv-events-retained-batches", str(RETAINED), "--kv-events-subscriber-buffer", "16",
               "--stall-timeout-seconds", str(STALL_S))
HEADS = ("You are a helpful assistant. Answer briefly and politely. ",
         "Translate the following sentence into French, keeping the tone. ",
         "Summarize the text below in one line for a busy reader. ")
#: A client whose subscription stream gets a tiny receive window and a connection of its own:
#: a reader that never calls next() then stops the server's writes after a few batches.
STUCK_CHANNEL = (("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0),
                 ("grpc.use_local_subchannel_pool", 1))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("kv-events") / "server.log", *SERVER_ARGS) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[OpenEngineClient]:
    with OpenEngineClient(server.address) as c:
        yield c


def subscribe(client: OpenEngineClient, include_snapshot: bool = False, start: int = 0,
              ranks: tuple[int, ...] = ()) -> KvSubscriber:
    request = oe.SubscribeKvEventsRequest(include_snapshot=include_snapshot, start_sequence_number=start,
                                          data_parallel_ranks=list(ranks))
    return KvSubscriber(client.control, request, timeout=120)


def snapshot_number(client: OpenEngineClient) -> tuple[int, KvView]:
    """The newest batch number and the cache it describes, from a fresh snapshot subscriber."""
    sub = subscribe(client, include_snapshot=True)
    try:
        assert sub.wait_responses(1), sub.describe()
        snap = sub.batches[0]
    finally:
        sub.close()
    view = KvView()
    view.apply(snap)
    return snap.sequence_number, view


def generate(client: OpenEngineClient, i: int, tag: str, max_tokens: int = 4) -> float:
    """One greedy request; a shared head (prefix hits), a tail of its own, a salt for every
    third request. Returns its wall time."""
    prompt = HEADS[i % 3] + f"Request {tag} number {i}: " + f"word{i} " * (12 + i % 5 * 8)
    req = greedy_request(f"{tag}-{i}", prompt, max_tokens=max_tokens)
    if i % 3 == 2:
        req.kv.cache_salt = f"salt-{i % 2}"
    start = time.perf_counter()
    events = list(client.generate(req, timeout=120))
    assert events and events[-1].WhichOneof("event") == "finished", events[-1:]
    return time.perf_counter() - start


def run_workload(client: OpenEngineClient, tag: str, n: int, threads: int = 3) -> list[threading.Thread]:
    def worker(k: int) -> None:
        for i in range(k, n, threads):
            generate(client, i, tag)

    workers = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(threads)]
    for w in workers:
        w.start()
    return workers


def numbers(sub: KvSubscriber) -> list[int]:
    return [b.sequence_number for b in sub.batches]


def view_of(batches: list) -> KvView:
    view = KvView()
    for batch in batches:
        view.apply(batch)
    assert not view.problems, view.problems[:3]
    return view


def test_snapshot_plus_live_mid_workload_is_gap_free_and_agrees(client: OpenEngineClient) -> None:
    """E1/E2: a snapshot taken while requests run, then live batches, numbered S, S+1, …;
    its view equals the one of a subscriber that started before the workload, and both equal
    a fresh subscriber's snapshot at the end. Eight replaying subscribers see one stream."""
    early = subscribe(client, include_snapshot=True)
    assert early.wait_responses(1), early.describe()
    start = early.batches[0].sequence_number + 1
    eight = [subscribe(client, start=start) for _ in range(8)]  # a replay from the next number: all alike
    workers = run_workload(client, "mid", n=18)
    assert early.wait_sequence(start + 3, timeout=60), "no live batches while the workload runs"
    mid = subscribe(client, include_snapshot=True)
    for w in workers:
        w.join(120)
    last, fresh = snapshot_number(client)
    subs = [early, mid, *eight]
    try:
        assert all(s.wait_sequence(last, timeout=20) for s in subs), [s.describe() for s in subs]
        snap = mid.batches[0].sequence_number
        assert start < snap < last, "the second snapshot was not taken mid-workload"
        assert numbers(early) == list(range(start - 1, last + 1))
        assert numbers(mid) == list(range(snap, last + 1))  # snapshot = last live it includes, then +1
        early_view, mid_view = view_of(early.batches), view_of(mid.batches)
        assert early_view.blocks == mid_view.blocks == fresh.blocks and fresh.blocks
        events = [e.WhichOneof("event") for b in early.batches for e in b.events]
        assert "block_removed" in events, "the workload caused no eviction"
        for s in eight:
            assert s.batches == early.batches[1:]  # the same messages, timestamps included
        assert not any(s.errors for s in subs)
    finally:
        for s in subs:
            s.close()


def test_replay_from_a_retained_number_returns_the_same_batches(client: OpenEngineClient) -> None:
    first, _ = snapshot_number(client)
    live = subscribe(client, start=first + 1)
    for w in run_workload(client, "replay", n=6):
        w.join(120)
    last, _ = snapshot_number(client)
    replay = subscribe(client, start=first + 1)
    try:
        assert live.wait_sequence(last) and replay.wait_sequence(last), (live.describe(), replay.describe())
        assert last - first >= 3 and numbers(replay) == list(range(first + 1, last + 1))
        assert replay.batches == live.batches
    finally:
        live.close()
        replay.close()


def resets_until(server: ServerProcess, client: OpenEngineClient, number: int) -> int:
    """SIGUSR1 (prefix-cache reset: one AllBlocksCleared batch each) until batch ``number``
    exists and no reset is still on its way; returns the newest batch number."""
    deadline = time.monotonic() + 30
    while snapshot_number(client)[0] < number:
        assert time.monotonic() < deadline, "SIGUSR1 resets published too few batches"
        for _ in range(10):
            server.signal(signal.SIGUSR1)
            time.sleep(0.01)
    last = -1
    while last != (last := snapshot_number(client)[0]):
        time.sleep(0.2)
    return last


def test_replay_from_an_expired_number_ends_with_one_error_then_ok(server: ServerProcess,
                                                                    client: OpenEngineClient) -> None:
    last = resets_until(server, client, RETAINED + 2)
    for start in (1, last - RETAINED, last + 5):  # expired, just expired, not yet published
        sub = subscribe(client, start=start)
        try:
            assert sub.wait_end(10), sub.describe()
            assert sub.code == grpc.StatusCode.OK and sub.kinds() == ["error"], (start, sub.describe())
            error = sub.errors[0]
            assert error.code == oe.ERROR_CODE_INVALID_ARGUMENT and not error.retryable
            assert "not possible" in error.message
        finally:
            sub.close()
    recent = subscribe(client, start=last - 9)  # fewer than --kv-events-subscriber-buffer batches
    try:
        assert recent.wait_sequence(last) and numbers(recent) == list(range(last - 9, last + 1))
        assert not recent.errors
    finally:
        recent.close()


def test_a_replay_of_the_whole_retained_window_is_served(server: ServerProcess, client: OpenEngineClient) -> None:
    last = resets_until(server, client, RETAINED + 2)
    oldest = subscribe(client, start=last - RETAINED + 1)
    try:
        assert oldest.wait_sequence(last, timeout=5), oldest.describe()
        assert numbers(oldest) == list(range(last - RETAINED + 1, last + 1)) and not oldest.errors
    finally:
        oldest.close()


def test_sigusr1_clears_the_cache_in_one_batch(server: ServerProcess, client: OpenEngineClient) -> None:
    """E3: a prefix-cache reset is one batch holding exactly one AllBlocksCleared."""
    generate(client, 0, "reset")
    assert client.load().attributes["cached_kv_blocks"] > 0
    sub = subscribe(client, include_snapshot=True)
    try:
        assert sub.wait_responses(1) and sub.batches[0].events
        server.signal(signal.SIGUSR1)
        assert sub.wait_responses(2), sub.describe()
        cleared = sub.batches[1]
        assert [e.WhichOneof("event") for e in cleared.events] == ["all_blocks_cleared"]
        assert cleared.sequence_number == sub.batches[0].sequence_number + 1
    finally:
        sub.close()
    assert snapshot_number(client)[1].blocks == {}


def test_getload_cached_blocks_drop_to_zero_after_sigusr1(server: ServerProcess, client: OpenEngineClient) -> None:
    generate(client, 0, "reset-load")
    assert client.load().attributes["cached_kv_blocks"] > 0
    number = snapshot_number(client)[0]
    server.signal(signal.SIGUSR1)
    deadline = time.monotonic() + 5
    while snapshot_number(client)[0] == number and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    assert client.load().attributes["cached_kv_blocks"] == 0


def subscribers_reach(client: OpenEngineClient, count: int, timeout: float = 10.0) -> int:
    """GetLoad's ``kv_event_subscribers`` once it equals ``count``, or when ``timeout`` ran out."""
    deadline = time.monotonic() + timeout
    while (seen := int(client.load().attributes["kv_event_subscribers"])) != count and time.monotonic() < deadline:
        time.sleep(0.05)
    return seen


def test_getload_counts_the_kv_event_streams_being_fed(client: OpenEngineClient) -> None:
    """``LoadInfo.attributes["kv_event_subscribers"]``: the streams the engine feeds, one less as each
    client leaves (a subscription the server kept after its client left would show here)."""
    assert subscribers_reach(client, 0) == 0
    live, snapshot = subscribe(client), subscribe(client, include_snapshot=True)
    try:
        assert snapshot.wait_responses(1), snapshot.describe()
        assert subscribers_reach(client, 2) == 2
        live.close()
        assert subscribers_reach(client, 1) == 1
    finally:
        live.close()
        snapshot.close()
    assert subscribers_reach(client, 0) == 0


def refused(sub: KvSubscriber) -> str:
    assert sub.wait_end(10), sub.describe()
    assert sub.responses == [], sub.describe()
    return sub.code.name


def test_bad_subscription_and_source_requests_are_invalid_argument(client: OpenEngineClient) -> None:
    assert refused(subscribe(client, include_snapshot=True, start=3)) == "INVALID_ARGUMENT"
    for ranks in ((1,), (0, 0), (0, 7)):
        assert refused(subscribe(client, ranks=ranks)) == "INVALID_ARGUMENT"
        with pytest.raises(grpc.RpcError) as err:
            client.control.GetKvEventSources(oe.GetKvEventSourcesRequest(data_parallel_ranks=ranks), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ok = subscribe(client, include_snapshot=True, ranks=(0,))
    try:
        assert ok.wait_responses(1) and ok.batches[0].data_parallel_rank == 0
    finally:
        ok.close()
    for ranks in ([], [0]):  # no --kv-events-zmq: no compatibility source; the stream is this service
        sources = client.control.GetKvEventSources(oe.GetKvEventSourcesRequest(data_parallel_ranks=ranks),
                                                   timeout=10)
        assert list(sources.sources) == []


def latencies(client: OpenEngineClient, tag: str, n: int = 4) -> list[float]:
    return [generate(client, 100 + i, tag, max_tokens=8) for i in range(n)]


STUCK: dict[str, object] = {}  # the stuck call, for the next test (what its client sees)
STUCK_DEADLINE_S = 20.0


def wait_for_log(server: ServerProcess, text: str, timeout: float) -> float:
    """Seconds until ``text`` appears in the server log (inf when it does not within ``timeout``)."""
    start = time.monotonic()
    while text not in server.log_tail(200_000):
        if time.monotonic() - start > timeout:
            return float("inf")
        time.sleep(0.1)
    return time.monotonic() - start


def test_a_subscriber_that_never_reads_is_dropped_and_generate_is_unaffected(
        server: ServerProcess, client: OpenEngineClient) -> None:
    """A stream that is never read (a tiny receive window, next() never called): the server
    gives up on it within the stall timeout, and Generate keeps its latency meanwhile."""
    before = latencies(client, "lat-before")
    stuck_client = OpenEngineClient(server.address, channel_options=STUCK_CHANNEL)
    call = stuck_client.control.SubscribeKvEvents(oe.SubscribeKvEventsRequest(include_snapshot=True),
                                                  timeout=STUCK_DEADLINE_S)
    STUCK.update(client=stuck_client, call=call, opened=time.monotonic())
    during = latencies(client, "lat-stuck")  # their batches pile up behind the unread stream
    resets_until(server, client, snapshot_number(client)[0] + 40)  # more than its 16-batch buffer
    gave_up_s = wait_for_log(server, "stopped reading", STALL_S + 5)
    print(f"\nGenerate wall time, median of {len(before)}: {statistics.median(before) * 1e3:.0f} ms without, "
          f"{statistics.median(during) * 1e3:.0f} ms with a stuck subscriber ({before} / {during})")
    assert gave_up_s < STALL_S + 5, "the server never gave up on the stuck subscriber"
    assert statistics.median(during) < 2 * statistics.median(before), (before, during)


def test_the_stuck_subscriber_sees_its_stream_end_with_a_failure() -> None:
    if "call" not in STUCK:
        pytest.skip("needs the stuck subscriber of the previous test")
    call = STUCK["call"]
    received, code = [], grpc.StatusCode.OK
    try:
        received = [r.WhichOneof("event") for r in call]
    except grpc.RpcError as err:
        code = err.code()
    finally:
        STUCK["client"].close()
    waited = time.monotonic() - STUCK["opened"]
    print(f"\nstuck stream: {code.name} after {len(received)} responses, {waited:.1f} s after it opened")
    # X1: its window was full, so the end is a status, seen right after what was in flight
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{code.name} after {waited:.1f} s, not disconnected"
    assert waited < STUCK_DEADLINE_S - 5, f"the end came only {waited:.1f} s after the stream opened"
    assert "error" not in received, received


def test_a_drain_does_not_wait_for_a_subscriber_that_never_reads(tmp_path) -> None:  # noqa: ANN001
    """SIGTERM with a subscriber whose receive window is full: the drain's end event cannot reach it,
    and it is disconnected after the stall timeout. Its handler waited behind the stuck write in
    context.abort, so the subscriber stayed counted and the exit waited the whole 16 s flush bound
    (found by review of the Generate case: 16.7 s here, grace period 1 s)."""
    with running_server(tmp_path / "server.log", *SERVER_ARGS, "--shutdown-grace-seconds", "1") as server:
        with OpenEngineClient(server.address) as client, \
                OpenEngineClient(server.address, channel_options=STUCK_CHANNEL) as stuck:
            call = stuck.control.SubscribeKvEvents(oe.SubscribeKvEventsRequest(include_snapshot=True), timeout=60)
            resets_until(server, client, snapshot_number(client)[0] + 40)  # its window fills
            signalled = time.monotonic()
            server.signal(signal.SIGTERM)
            assert server.proc.wait(60) == 0
            exited_s = time.monotonic() - signalled
            call.cancel()
    assert exited_s < 1 + STALL_S + 4, f"the drain took {exited_s:.1f} s"
