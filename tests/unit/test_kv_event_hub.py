"""The KV event hub through the in-process engine (RULES E1–E4; ref choices in
``refengine/engine/kv_events.py`` and ``refengine.types.KvEventBatch``).

A subscriber that applies a snapshot and then the live batches to its own view ends up with
exactly the pool's published set, whenever it subscribed, through evictions (a small pool),
prefix-cache resets, cache salts and ``num_sequences`` > 1. Sequence numbers have no gap and
no duplicate; replay gives the same batches again; an expired replay point, a stuck
subscriber and a bad request each end the subscription with a message, never the engine.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from refengine.config import CacheConfig, EngineConfig, KvEventsConfig, SchedulerConfig
from refengine.engine.engine import Engine
from refengine.engine.kv_events import KvEventHub, KvEventSubscription
from refengine.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    FeatureDisabledError,
    GenerationRequest,
    InvalidRequestError,
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
SALTS = (None, "a", "b")


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_hf_model(vocab_size=VOCAB, max_position_embeddings=256)
    return model_config_from_hf(model), hf_weights(model)


def make_engine(tiny, num_blocks: int = 40, retained: int = 10_000, buffer: int = 1024,
                enabled: bool = True) -> Engine:
    config, weights = tiny
    return Engine(EngineConfig(max_model_len=256, cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
                               max_sequences_per_request=4,
                               scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
                               kv_events=KvEventsConfig(enabled=enabled, retained_batches=retained,
                                                        subscriber_buffer=buffer)),
                  config, weights, TOKENIZER, model_fingerprint="tiny")


class View:
    """One subscriber: its batches in order and the prefix cache they describe (hash -> parent);
    a replay from the middle of the stream continues another view, so it only keeps batches."""

    def __init__(self, engine: Engine, include_snapshot: bool = False, start: int = 0) -> None:
        self.complete = include_snapshot or start == 1 or engine.kv_events.last_sequence_number == 0
        self.sub: KvEventSubscription = engine.subscribe_kv_events(lambda: None, include_snapshot, start)
        self.batches: list[KvEventBatch] = []
        self.blocks: dict[bytes, bytes | None] = {}
        self.failure: str | None = None

    def drain(self) -> None:
        batches, self.failure = self.sub.take()
        for batch in batches:
            self.apply(batch)

    def apply(self, batch: KvEventBatch) -> None:
        if self.batches:  # E1: no gap, no duplicate (a snapshot shares the number of its last live batch)
            assert batch.sequence_number == self.batches[-1].sequence_number + 1, (
                f"batch {batch.sequence_number} after {self.batches[-1].sequence_number}")
        assert not (batch.snapshot and self.batches), "a snapshot after the first batch"
        self.batches.append(batch)
        for event in batch.events if self.complete else ():
            if isinstance(event, BlockStored):
                assert event.block_hash not in self.blocks, "a block stored twice"
                assert event.parent_hash is None or event.parent_hash in self.blocks, "a child before its parent"
                self.blocks[event.block_hash] = event.parent_hash
            elif isinstance(event, BlockRemoved):
                del self.blocks[event.block_hash]  # KeyError = removal of a block never stored
            else:
                assert isinstance(event, AllBlocksCleared)
                self.blocks.clear()


def request(rng: random.Random, rid: str, heads: list[list[int]]) -> GenerationRequest:
    """A prompt that often shares a head with others (prefix hits, duplicates), a random
    salt, 1–3 outputs and a few tokens each."""
    prompt = list(rng.choice(heads)) if rng.random() < 0.7 else []
    prompt += [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 14))]
    n = rng.choice((1, 1, 2, 3))
    return GenerationRequest(rid, prompt_token_ids=prompt,
                             sampling=SamplingParams(temperature=1.0, seed=rng.randrange(1000), num_sequences=n),
                             stopping=StoppingParams(max_tokens=rng.randrange(2, 9), ignore_eos=True),
                             kv=KvParams(cache_salt=rng.choice(SALTS)))


def published(engine: Engine) -> set[bytes]:
    return set(engine.core.pool.hash_to_block)


def run_random_workload(engine: Engine, seed: int, steps: int = 160) -> tuple[list[View], int, list[int]]:
    """Steps a random workload; between steps: new requests, resets, and new subscribers
    (with a snapshot) whose views are checked against the pool after every step. Returns the
    views (the first subscribed before any work), the number of resets, and each snapshot
    subscriber's expected snapshot number."""
    rng = random.Random(seed)
    heads = [[rng.randrange(3, VOCAB) for _ in range(12)] for _ in range(3)]
    views, resets, numbers = [View(engine)], 0, []
    for step in range(steps):
        if rng.random() < 0.3 and len(engine.core.requests) < 6:
            engine.add_request(request(rng, f"s{seed}-{step}", heads))
        if rng.random() < 0.03:
            engine.reset_prefix_cache()
            resets += 1
        if rng.random() < 0.06:
            numbers.append(engine.kv_events.last_sequence_number)
            views.append(View(engine, include_snapshot=True))
        engine.step()
        for view in views:
            view.drain()
            assert view.failure is None, view.failure
            assert view.blocks.keys() == published(engine), f"step {step}: a view differs from the pool"
    return views, resets, numbers


@pytest.mark.parametrize("seed", range(3))
def test_snapshot_plus_live_equals_the_published_set(tiny, seed: int) -> None:
    engine = make_engine(tiny)
    views, resets, numbers = run_random_workload(engine, seed)
    while engine.has_unfinished_requests:
        engine.step()
    for view in views:
        view.drain()
        assert view.blocks.keys() == published(engine)
    first, joined = views[0], views[1:]
    assert joined, "no subscriber joined mid-workload"
    for view, number in zip(joined, numbers, strict=True):
        snap = view.batches[0]
        assert snap.snapshot and snap.sequence_number == number  # = the last live batch it includes
        if len(view.batches) > 1:
            assert view.batches[1].sequence_number == number + 1
        assert view.blocks == first.blocks  # parents too, not only the keys
    # The workload exercised what the test is about: evictions, salts, resets.
    events = [e for b in first.batches for e in b.events]
    assert any(isinstance(e, BlockRemoved) for e in events), "no eviction happened"
    salts = {k for e in events if isinstance(e, BlockStored) for k in e.extra_keys if k.startswith("salt:")}
    assert salts == {"salt:a", "salt:b"}
    cleared = [b for b in first.batches if any(isinstance(e, AllBlocksCleared) for e in b.events)]
    assert len(cleared) == resets  # E3: one AllBlocksCleared per reset, alone in its batch
    assert all(len(b.events) == 1 for b in cleared)
    assert [b.sequence_number for b in first.batches] == list(range(1, len(first.batches) + 1))


def test_equal_prompts_with_different_salts_share_no_block(tiny) -> None:
    """K2/E4: the salt is in every block's hash; a salted prompt stores new blocks."""
    engine = make_engine(tiny, num_blocks=64)
    view = View(engine)
    prompt = list(range(10, 10 + 3 * BLOCK))
    stored: dict[str | None, set[bytes]] = {}
    for salt in SALTS:
        engine.run_until_done([GenerationRequest(f"salt-{salt}", prompt_token_ids=prompt,
                                                 stopping=StoppingParams(max_tokens=1),
                                                 kv=KvParams(cache_salt=salt))])
        before = set(view.blocks)
        view.drain()
        stored[salt] = set(view.blocks) - before
    assert all(len(s) == 3 for s in stored.values()), stored
    assert not (stored[None] & stored["a"] or stored["a"] & stored["b"] or stored[None] & stored["b"])


def test_replay_from_a_retained_number_gives_the_same_batches(tiny) -> None:
    engine = make_engine(tiny, retained=10_000)
    views, _, _ = run_random_workload(engine, seed=7, steps=80)
    first = views[0]
    assert len(first.batches) > 10
    for start in (1, 5, len(first.batches), len(first.batches) + 1):
        replay = View(engine, start=start)
        replay.drain()
        assert replay.failure is None
        assert replay.batches == first.batches[start - 1:]  # the same objects: numbers, timestamps, events
    live = View(engine)  # start 0: live from the next batch only
    live.drain()
    assert live.batches == []


def test_replay_from_an_expired_or_future_number_fails_with_a_message(tiny) -> None:
    engine = make_engine(tiny, retained=4)
    run_random_workload(engine, seed=3, steps=80)
    last = engine.kv_events.last_sequence_number
    assert last > 8
    oldest = last - 3
    ok = View(engine, start=oldest)
    ok.drain()
    assert [b.sequence_number for b in ok.batches] == list(range(oldest, last + 1)) and ok.failure is None
    subscribers = engine.stats().kv_event_subscribers
    for start in (1, oldest - 1):
        expired = View(engine, start=start)
        expired.drain()
        assert expired.batches == [] and expired.failure is not None
        assert f"oldest retained batch is {oldest}" in expired.failure and "include_snapshot" in expired.failure
    future = View(engine, start=last + 2)
    future.drain()
    assert future.batches == [] and f"newest batch is {last}" in (future.failure or "")
    assert engine.stats().kv_event_subscribers == subscribers  # a failed subscription is not kept


def test_snapshot_and_replay_exclude_each_other_and_disabled_events_refuse(tiny) -> None:
    engine = make_engine(tiny)
    with pytest.raises(InvalidRequestError, match="exclude each other"):
        engine.subscribe_kv_events(lambda: None, include_snapshot=True, start_sequence_number=3)
    off = make_engine(tiny, enabled=False)
    with pytest.raises(FeatureDisabledError, match="disabled"):  # FAILED_PRECONDITION, as R5's LoRA (ref)
        off.subscribe_kv_events(lambda: None)
    assert off.core.pool._events is None  # no subscriber can exist: nothing is recorded


def test_a_subscriber_that_never_takes_is_cut_off_and_the_engine_runs_on(tiny) -> None:
    engine = make_engine(tiny, buffer=3)
    calls: list[float] = []
    stuck = engine.subscribe_kv_events(lambda: calls.append(time.perf_counter()))
    healthy = Drainer(engine)
    engine.start()
    try:
        rng = random.Random(11)
        for i in range(8):  # one after the other: each prompt's blocks are stored in batches of their own
            stream = engine.add_request(request(rng, f"stuck-{i}", [[]]))
            stream.result(timeout=60)  # the steps never waited on the stuck subscriber
    finally:
        engine.shutdown()
    received, failures = healthy.stop()
    assert len(received) > 3 and not failures
    batches, failure = stuck.take()
    assert batches == received[:3]  # it keeps what it held, in order, then one failure
    assert failure is not None and "too slow" in failure and "3 batches unread" in failure
    assert engine.stats().kv_event_subscribers == 1  # dropped from the hub: only ``healthy`` is fed
    assert len(calls) == 4  # three batches and the failure; nothing after it


class Drainer:
    """A subscriber that takes whatever is ready on its own thread (woken by ``on_ready``)."""

    def __init__(self, engine: Engine) -> None:
        self.ready, self.done = threading.Event(), threading.Event()
        self.sub = engine.subscribe_kv_events(self.ready.set)
        self.batches: list[KvEventBatch] = []
        self.failures: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            if self.ready.wait(0.05):
                self.ready.clear()
                self._take()

    def _take(self) -> None:
        batches, failure = self.sub.take()
        self.batches.extend(batches)
        self.failures.extend([failure] if failure else [])

    def stop(self) -> tuple[list[KvEventBatch], list[str]]:
        self.done.set()
        self.thread.join(10)
        self._take()  # anything published after the thread's last take
        return self.batches, self.failures


def test_eight_subscribers_draining_in_threads_see_identical_streams(tiny) -> None:
    engine = make_engine(tiny, num_blocks=32)
    drainers = [Drainer(engine) for _ in range(8)]
    engine.start()
    rng = random.Random(5)
    heads = [[rng.randrange(3, VOCAB) for _ in range(12)] for _ in range(3)]
    try:
        streams = [engine.add_request(request(rng, f"eight-{i}", heads)) for i in range(16)]
        for i, stream in enumerate(streams):
            stream.result(timeout=60)
            if i == 8:
                engine.reset_prefix_cache()
    finally:
        engine.shutdown()
    received = [d.stop() for d in drainers]
    first, failures = received[0]
    assert len(first) > 5 and not failures
    assert [b.sequence_number for b in first] == list(range(1, len(first) + 1))
    assert any(isinstance(e, AllBlocksCleared) for b in first for e in b.events)
    assert all(r == received[0] for r in received[1:])


def test_hub_snapshot_numbering_before_any_batch() -> None:
    """A snapshot before any live batch is numbered 0; the first live batch is 1."""
    hub = KvEventHub(retained_batches=8, subscriber_buffer=8)
    sub = hub.subscribe(lambda: None, snapshot=[])
    hub.publish([AllBlocksCleared()])
    batches, failure = sub.take()
    assert [(b.sequence_number, b.snapshot) for b in batches] == [(0, True), (1, False)] and failure is None


def test_a_replay_longer_than_the_subscriber_buffer_is_possible() -> None:
    """The replay is not counted against the buffer: a full buffer of live batches published
    before the subscriber's first ``take`` still fits (before, the first live one cut it off)."""
    hub = KvEventHub(retained_batches=100, subscriber_buffer=8)
    for _ in range(20):
        hub.publish([AllBlocksCleared()])
    sub = hub.subscribe(lambda: None, start_sequence_number=1)
    for _ in range(8):
        hub.publish([AllBlocksCleared()])
    batches, failure = sub.take()
    assert failure is None and [b.sequence_number for b in batches] == list(range(1, 29))
    for _ in range(9):
        hub.publish([AllBlocksCleared()])
    batches, failure = sub.take()
    assert [b.sequence_number for b in batches] == list(range(29, 37))
    assert failure is not None and "resubscribe from sequence number 37" in failure


def test_the_too_slow_message_names_the_first_missed_batch() -> None:
    hub = KvEventHub(retained_batches=100, subscriber_buffer=3)
    sub = hub.subscribe(lambda: None)
    for _ in range(5):
        hub.publish([AllBlocksCleared()])
    batches, failure = sub.take()
    assert [b.sequence_number for b in batches] == [1, 2, 3]
    assert failure is not None and "resubscribe from sequence number 4" in failure


def test_an_engine_fault_publishes_a_consistent_view_and_frees_every_block(tiny, monkeypatch) -> None:
    """A step that raises ends every request (``Engine.fail_all``); its KV events are
    published like a step's: the view still equals the pool, and no block stays in use."""
    engine = make_engine(tiny)
    rng = random.Random(7)
    heads = [[rng.randrange(3, VOCAB) for _ in range(12)]]
    view = View(engine)
    for i in range(4):
        engine.add_request(request(rng, f"f{i}", heads))
    for _ in range(3):
        engine.step()
    assert engine.core.pool.num_used > 0

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(engine.core.runner, "execute", broken)
    with pytest.raises(RuntimeError):
        engine.step()
    outputs = engine.fail_all("engine fault: injected")
    assert outputs and all(o.finished and o.error is not None for o in outputs)
    view.drain()
    assert view.failure is None and view.blocks.keys() == published(engine)
    assert engine.core.pool.num_used == 0 and not engine.has_unfinished_requests


def test_a_snapshot_between_a_failed_step_and_fail_all_repeats_no_block(tiny, monkeypatch) -> None:
    """E2: a step that raises after its blocks were cached still publishes their events as it
    ends, so a snapshot taken before the loop's ``fail_all`` (the step lock is free between
    them) holds exactly what the live stream told; before, ``fail_all`` published those
    ``BlockStored`` again after the snapshot."""
    engine = make_engine(tiny)
    view = View(engine)
    engine.add_request(GenerationRequest("g", prompt_token_ids=list(range(3, 15)), sampling=SamplingParams(),
                                         stopping=StoppingParams(max_tokens=4, ignore_eos=True)))

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault after the step cached its prompt's blocks")

    monkeypatch.setattr(engine.core.outputs, "append_token", broken)
    with pytest.raises(RuntimeError):
        engine.step()
    late = View(engine, include_snapshot=True)  # in the window the step loop leaves before fail_all
    engine.fail_all("engine fault: injected")
    view.drain()
    late.drain()  # View.apply fails on a block stored twice
    assert view.failure is None and late.failure is None
    assert len(late.batches[0].events) == 3, "the snapshot: the prompt's three full blocks"
    assert view.blocks.keys() == late.blocks.keys() == published(engine)


def test_a_wake_up_that_raises_ends_that_subscription_alone() -> None:
    """A subscriber whose wake-up raises (a gRPC server's event loop already closed) once ended
    ``publish`` before the subscribers after it, on every batch: they missed them all without a
    failure (found by review). Now it alone ends; the others get every batch."""
    hub = KvEventHub(retained_batches=16, subscriber_buffer=16)
    closed = asyncio.new_event_loop()
    closed.close()
    broken = hub.subscribe(lambda: closed.call_soon_threadsafe(lambda: None))
    healthy = hub.subscribe(lambda: None)
    hub.publish([AllBlocksCleared()])
    hub.publish([AllBlocksCleared()])
    batches, failure = healthy.take()
    assert [b.sequence_number for b in batches] == [1, 2] and failure is None
    assert broken.closed and hub.num_subscribers == 1
