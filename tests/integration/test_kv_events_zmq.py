"""The vLLM-format ZMQ KV event publisher against a tiny in-process engine, on real sockets.

What a vLLM consumer (Dynamo's KV router) relies on: ``[topic, seq, payload]`` frames with
``seq`` from 0 without gaps; the payload a msgpack array ``[ts, events, rank]`` of tagged
maps with unsigned 64-bit integer hashes; the ROUTER replay ending with the -1 marker; and
a view built from the stream that equals the engine's published blocks.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable

import msgpack
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from refengine.config import CacheConfig, EngineConfig, KvEventsConfig, SchedulerConfig
from refengine.engine.engine import Engine
from refengine.server.kv_events_zmq import ZmqKvEventPublisher
from refengine.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    GenerationRequest,
    KvEventBatch,
    KvParams,
    SamplingParams,
    StoppingParams,
)
from tests.tiny_models import hf_weights, make_tiny_hf_model, model_config_from_hf
from tests.unit.tokenizer_fixture import byte_fallback_tokenizer

TOKENIZER = byte_fallback_tokenizer()
VOCAB = len(TOKENIZER)
BLOCK = 4
MEDIUM = "CPU"
TIMEOUT_S = 5.0
END = (-1).to_bytes(8, "big", signed=True)
STORED_KEYS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
               "lora_name"}

pytestmark = pytest.mark.timeout(60)


def u64(digest: bytes) -> int:
    """The consumer-side hash, as vLLM's ``maybe_convert_block_hash`` writes it: the 32-byte
    key as a big-endian integer, masked to its low 64 bits."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_hf_model(vocab_size=VOCAB, max_position_embeddings=256)
    return model_config_from_hf(model), hf_weights(model)


@pytest.fixture(scope="module")
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def make_engine(tiny, num_blocks: int = 64, subscriber_buffer: int = 1024) -> Engine:
    config, weights = tiny
    return Engine(EngineConfig(max_model_len=256, cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
                               scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16),
                               kv_events=KvEventsConfig(subscriber_buffer=subscriber_buffer)),
                  config, weights, TOKENIZER, model_fingerprint="tiny")


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def request(rid: str, prompt: list[int], max_tokens: int = 5, salt: str | None = None) -> GenerationRequest:
    return GenerationRequest(rid, prompt_token_ids=prompt, sampling=SamplingParams(temperature=0.0),
                             stopping=StoppingParams(max_tokens=max_tokens, ignore_eos=True),
                             kv=KvParams(cache_salt=salt))


def free_port() -> int:
    """A port for the one test of an explicit port; the others bind port 0 (no window in which
    another socket takes the port) and read what they got with ``live_at`` / ``replay_at``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def live_at(pub: ZmqKvEventPublisher) -> str:
    """The endpoint a started publisher's PUB socket is bound to."""
    return f"tcp://127.0.0.1:{pub.describe('127.0.0.1')['port']}"


def replay_at(pub: ZmqKvEventPublisher) -> str:
    """The endpoint a started publisher's replay (ROUTER) socket is bound to."""
    return pub.describe("127.0.0.1")["replay_endpoint"]


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class Mirror:
    """A second engine subscription, taken beside the publisher's: the engine's own batches."""

    def __init__(self, engine: Engine) -> None:
        self.sub = engine.subscribe_kv_events(lambda: None)
        self.seen: list[KvEventBatch] = []

    def batches(self) -> list[KvEventBatch]:
        """Every batch with events so far."""
        batches, failure = self.sub.take()
        assert failure is None
        self.seen += [b for b in batches if b.events]
        return self.seen


def subscriber(ctx: zmq.Context, endpoint: str, topic: bytes = b"", rcvhwm: int | None = None) -> zmq.Socket:
    """A SUB socket whose connection is up (no slow-joiner loss of the first messages);
    ``rcvhwm``: the most messages it queues (set before connecting, where it takes effect)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    if rcvhwm is not None:
        sub.setsockopt(zmq.RCVHWM, rcvhwm)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.connect(endpoint)
    assert monitor.poll(int(TIMEOUT_S * 1000)), "SUB never connected"
    recv_monitor_message(monitor)
    sub.disable_monitor()
    monitor.close(linger=0)
    time.sleep(0.1)  # the subscription reaches the PUB side
    return sub


def receive(sub: zmq.Socket, n: int) -> list[list[bytes]]:
    messages = []
    for _ in range(n):
        assert sub.poll(int(TIMEOUT_S * 1000)), f"got {len(messages)} of {n} messages"
        messages.append(sub.recv_multipart())
    assert not sub.poll(100), "more messages than engine batches"
    return messages


def replay(ctx: zmq.Context, endpoint: str, start: int, start_frame: bytes | None = None) -> list[tuple[int, bytes]]:
    """What a vLLM consumer does after a gap: DEALER [b"", start] → [b"", seq, payload]…, END
    (``start_frame``: send these bytes as the start instead)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big") if start_frame is None else start_frame])
        out = []
        while True:
            assert dealer.poll(int(TIMEOUT_S * 1000)), "replay did not finish"
            frames = dealer.recv_multipart()
            assert len(frames) == 3 and frames[0] == b""
            if frames[1] == END:
                assert frames[2] == b""
                return out
            out.append((int.from_bytes(frames[1], "big"), frames[2]))
    finally:
        dealer.close(linger=0)


def decode(payload: bytes) -> list:
    batch = msgpack.unpackb(payload, raw=False)
    assert isinstance(batch, list) and len(batch) == 3, batch  # an array, not a map
    ts, events, rank = batch
    assert isinstance(ts, float) and abs(ts - time.time()) < 60
    assert rank == 0
    return events


def expected(event, salt: str | None = None) -> dict:
    """The tagged map a vLLM consumer expects for one engine event."""
    if isinstance(event, BlockStored):
        out = {"type": "BlockStored", "block_hashes": [u64(event.block_hash)],
               "parent_block_hash": None if event.parent_hash is None else u64(event.parent_hash),
               "token_ids": list(event.token_ids), "block_size": BLOCK, "medium": MEDIUM,
               "lora_id": None if event.lora is None else event.lora.lora_id,
               "lora_name": None if event.lora is None else event.lora.lora_name}
        salts = [k.removeprefix("salt:") for k in event.extra_keys if k.startswith("salt:")]
        if salts:
            out["cache_salt"] = salts[0]
        return out
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": [u64(event.block_hash)], "medium": MEDIUM}
    assert isinstance(event, AllBlocksCleared)
    return {"type": "AllBlocksCleared"}


def apply(view: dict[int, int | None], events: list[dict]) -> None:
    """A router's view: hash → parent, from stored / removed / cleared in order."""
    for event in events:
        if event["type"] == "BlockStored":
            parent = event["parent_block_hash"]
            assert parent is None or parent in view, "a child before its parent"
            for h in event["block_hashes"]:
                view[h] = parent
                parent = h
        elif event["type"] == "BlockRemoved":
            for h in event["block_hashes"]:
                del view[h]  # only known blocks are removed
        else:
            assert event["type"] == "AllBlocksCleared"
            view.clear()


def published(engine: Engine) -> set[int]:
    return {u64(h) for h in engine.core.pool.hash_to_block}


@pytest.fixture
def started(request):
    """Publishers started by a test, closed at its end."""
    publishers: list[ZmqKvEventPublisher] = []

    def start(engine: Engine, **kwargs) -> ZmqKvEventPublisher:
        kwargs.setdefault("endpoint", "tcp://127.0.0.1:0")
        kwargs.setdefault("replay_endpoint", "tcp://127.0.0.1:0")
        pub = ZmqKvEventPublisher(engine, medium=MEDIUM, **kwargs)
        pub.start()
        publishers.append(pub)
        return pub

    yield start
    for pub in publishers:
        pub.close()


def test_frames_decode_into_the_engines_own_batches(tiny, ctx, started) -> None:
    engine = make_engine(tiny)
    pub = started(engine, topic="kv")
    mirror = Mirror(engine)
    sub = subscriber(ctx, live_at(pub), b"kv")
    shared = ids(1, 12)
    engine.run_until_done([request("a", shared + ids(2, 5))])
    engine.run_until_done([request("b", shared + ids(3, 9)), request("s", ids(4, 10), salt="tenant-7")])
    engine.reset_prefix_cache()
    engine.run_until_done([request("c", ids(5, 8))])

    batches = mirror.batches()
    wait_until(lambda: pub.num_published == len(batches), "every batch published")
    messages = receive(sub, len(batches))
    salted = 0
    for seq, (message, batch) in enumerate(zip(messages, batches, strict=True)):
        topic, seq_bytes, payload = message
        assert topic == b"kv" and len(seq_bytes) == 8 and int.from_bytes(seq_bytes, "big") == seq
        events = decode(payload)
        assert msgpack.unpackb(payload, raw=False)[0] == pytest.approx(batch.timestamp_unix_nanos / 1e9)
        assert events == [expected(e) for e in batch.events]
        for event in events:
            for h in event.get("block_hashes", ()):
                assert type(h) is int and 0 <= h < 2**64
            if event["type"] == "BlockStored":
                assert set(event) - {"cache_salt"} == STORED_KEYS  # vLLM's defaults omitted
                assert len(event["token_ids"]) == event["block_size"] == BLOCK
                salted += event.get("cache_salt") == "tenant-7"
    salted_in_engine = [e for b in batches for e in b.events
                        if isinstance(e, BlockStored) and "salt:tenant-7" in e.extra_keys]
    assert salted == len(salted_in_engine) >= 10 // BLOCK  # every block of the salted request, only those
    kinds = {e["type"] for m in messages for e in decode(m[2])}
    assert kinds == {"BlockStored", "AllBlocksCleared"}
    sub.close(linger=0)


def test_replay_returns_the_retained_batches_and_the_end_marker(tiny, ctx, started) -> None:
    engine = make_engine(tiny)
    pub = started(engine)
    mirror = Mirror(engine)
    sub = subscriber(ctx, live_at(pub))
    for i in range(4):
        engine.run_until_done([request(f"r{i}", ids(10 + i, 9), max_tokens=2)])
    n = len(mirror.batches())
    assert n >= 4
    wait_until(lambda: pub.num_published == n, "every batch published")
    live = [(int.from_bytes(s, "big"), p) for _, s, p in receive(sub, n)]
    assert [s for s, _ in live] == list(range(n))
    assert replay(ctx, replay_at(pub), 0) == live
    assert replay(ctx, replay_at(pub), 2) == live[2:]
    assert replay(ctx, replay_at(pub), n) == []  # nothing newer: just the end marker
    assert replay(ctx, replay_at(pub), 0, start_frame=(2).to_bytes(4, "big")) == live[2:]  # as vLLM reads it
    for odd in (b"", bytes(9)):  # no u64: nothing replayed, but an answer all the same
        assert replay(ctx, replay_at(pub), 0, start_frame=odd) == []
    sub.close(linger=0)

    small = make_engine(tiny)
    bounded = started(small, buffer_steps=2)
    small_mirror = Mirror(small)
    for i in range(4):
        small.run_until_done([request(f"q{i}", ids(20 + i, 9), max_tokens=2)])
    m = len(small_mirror.batches())
    wait_until(lambda: bounded.num_published == m, "every batch published")
    assert [s for s, _ in replay(ctx, replay_at(bounded), 0)] == [m - 2, m - 1]


def test_a_consumer_view_ends_equal_to_the_pool_after_evictions_and_a_reset(tiny, ctx, started) -> None:
    engine = make_engine(tiny, num_blocks=10)  # a few prompts of 3-4 blocks each must evict
    pub = started(engine)
    mirror = Mirror(engine)
    sub = subscriber(ctx, live_at(pub))
    view: dict[int, int | None] = {}
    received = 0

    def follow() -> None:
        nonlocal received
        total = len(mirror.batches())
        wait_until(lambda: pub.num_published == total, "every batch published")
        for _, seq, payload in receive(sub, total - received):
            assert int.from_bytes(seq, "big") == received
            apply(view, decode(payload))
            received += 1

    shared = ids(30, 8)
    for i in range(6):
        engine.run_until_done([request(f"e{i}", shared + ids(31 + i, 6 + i), max_tokens=3)])
    follow()
    assert view.keys() == published(engine)
    engine.reset_prefix_cache()
    engine.run_until_done([request("after", shared + ids(50, 7)), request("salt", shared, salt="x")])
    follow()
    assert view.keys() == published(engine) and view

    replayed: dict[int, int | None] = {}
    for _, payload in replay(ctx, replay_at(pub), 0):
        apply(replayed, decode(payload))
    assert replayed == view
    kinds = [e["type"] for _, p in replay(ctx, replay_at(pub), 0) for e in decode(p)]
    assert "BlockRemoved" in kinds and "AllBlocksCleared" in kinds
    sub.close(linger=0)


def test_a_publisher_cut_off_by_the_engine_resends_the_cache_after_a_clear(tiny, ctx, started, caplog) -> None:
    """What a consumer sees of the cut-off: one message starting with AllBlocksCleared, then the cached
    blocks, then live batches again; what the operator sees: one warning saying so."""
    engine = make_engine(tiny, subscriber_buffer=1)
    gate = threading.Event()
    pub = ZmqKvEventPublisher(engine, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", medium=MEDIUM)
    drain = pub._drain

    def stalled() -> None:  # the publisher thread falls behind the engine once
        gate.wait(TIMEOUT_S)
        drain()

    pub._drain = stalled
    pub.start()
    try:
        for i in range(3):  # several batches while the publisher holds one: the engine cuts it off
            engine.run_until_done([request(f"c{i}", ids(60 + i, 9), max_tokens=2)])
        gate.set()
        view: dict[int, int | None] = {}
        messages = []

        def clears() -> int:
            messages[:] = [decode(p) for _, p in replay(ctx, replay_at(pub), 0)]
            return sum(events[:1] == [{"type": "AllBlocksCleared"}] for events in messages)

        wait_until(lambda: clears() == 1, "the snapshot after the cut-off")

        def caught_up() -> bool:
            messages[:] = [decode(p) for _, p in replay(ctx, replay_at(pub), 0)]
            view.clear()
            for events in messages:
                apply(view, events)
            return view.keys() == published(engine)

        wait_until(caught_up, "the snapshot")
        resync = messages[-1]
        assert resync[0] == {"type": "AllBlocksCleared"}
        assert {e["block_hashes"][0] for e in resync[1:]} == published(engine)
        engine.run_until_done([request("live", ids(70, 9), max_tokens=2)])  # live again after it
        wait_until(caught_up, "live batches after the snapshot")
        assert clears() == 1 and messages[-1][0] != {"type": "AllBlocksCleared"}
        resent = [r for r in caplog.records if "resending the cached blocks" in r.getMessage()]
        assert len(resent) == 1 and resent[0].levelname == "WARNING"
    finally:
        pub.close()


def test_describe_never_reports_a_wildcard_host(tiny, started) -> None:
    engine = make_engine(tiny)
    pub = started(engine, endpoint="tcp://0.0.0.0:0", replay_endpoint="tcp://*:0", topic="t", buffer_steps=7,
                  hwm=99)
    described = pub.describe("router.example")
    port = described.pop("port")
    replay_port = int(described.pop("replay_endpoint").removeprefix("tcp://router.example:"))
    assert port > 0 and replay_port > 0 and port != replay_port
    assert described == {"transport": "zmq", "host": "router.example", "topic": "t", "encoding": "msgpack",
                         "buffer_steps": 7, "hwm": 99, "max_queue_size": 1024, "data_parallel_rank": 0}

    explicit = free_port()
    local = started(engine, endpoint=f"tcp://127.0.0.1:{explicit}", replay_endpoint=None)
    d = local.describe("router.example")
    assert (d["host"], d["port"], d["replay_endpoint"]) == ("127.0.0.1", explicit, "")
    local.close()
    again = ZmqKvEventPublisher(engine, f"tcp://127.0.0.1:{explicit}")

    def rebound() -> bool:  # close() releases the port (ZMQ unbinds in its I/O thread, shortly after)
        try:
            again.start()
        except zmq.ZMQError:
            return False
        return True

    wait_until(rebound, "the port released")
    again.close()
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        ZmqKvEventPublisher(engine, "ipc:///tmp/kv")


def test_close_delivers_what_it_published_to_a_subscriber_a_little_behind(tiny, ctx, started) -> None:
    """close() publishes what the engine handed over; the PUB socket then closed with no linger
    and dropped what was still queued for a subscriber a little behind (found by review: 33 of
    300 received). Now the publisher's own context waits (up to 1 s) for the queue to drain
    before close() returns, so every message reaches a subscriber that keeps reading (a linger
    alone would not outlive the serve process, which exits next)."""
    engine = make_engine(tiny, subscriber_buffer=100_000)
    pub = started(engine, replay_endpoint=None)
    sub = subscriber(ctx, live_at(pub), rcvhwm=5)  # holds little: the rest waits on the publisher's side
    batches = 120
    for _ in range(batches):
        engine.kv_events.publish([BlockStored(random.randbytes(32), None, tuple(range(BLOCK)), BLOCK, ("m",))
                                  for _ in range(500)])
    wait_until(lambda: pub.num_published == batches, "every batch published")
    received = []

    def read() -> None:  # as a router does, reading on while the publisher closes
        while sub.poll(2000):
            sub.recv_multipart()
            received.append(1)

    reader = threading.Thread(target=read)
    reader.start()
    pub.close()
    reader.join()
    sub.close(linger=0)
    assert len(received) == batches

