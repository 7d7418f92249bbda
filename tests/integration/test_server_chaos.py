"""Concurrent Generate streams with every way of ending early at once, on the shared server:
client cancels mid-stream, deadlines, Control.Abort from another connection, and streams read
to their end, with random sampling, stops, logprobs, guided decoding and num_sequences. Each
stream read to its end keeps the stream invariants (``check_stream``: G9–G16, X1; an aborted one
ends with CANCELLED outputs and the usage of what it was sent); afterwards the server is idle with
no KV block in use and no stream open (A4, A5, K7: nothing leaks). The sequential field fuzz
(``test_fuzz_generate``) covers malformed requests; this covers endings racing each other."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from refengine.client import OpenEngineClient
from refengine.protocol import oe
from tests.integration.conftest import Stream, check_stream, wait_idle

NUM_REQUESTS, NUM_CLIENTS = 48, 12
PROMPTS = ("The capital of France is", "Once upon a time", "1, 2, 3, 4,", "def fibonacci(n):",
           "Emoji: \U0001f600\U0001f389 and then", "The quick brown fox " * 30)
FATES = ("read", "read", "cancel", "deadline", "abort")


@dataclass
class Outcome:
    request: oe.GenerateRequest
    fate: str
    stream: Stream


def random_request(rng: random.Random, index: int) -> oe.GenerateRequest:
    request = oe.GenerateRequest(request_id=f"chaos-{index}", prompt=rng.choice(PROMPTS))
    request.stopping.max_tokens = rng.choice([1, 4, 16, 48])
    if rng.random() < 0.5:
        request.sampling.temperature = rng.choice([0.0, 0.8])
        request.sampling.seed = rng.randrange(100)
    if rng.random() < 0.3:
        request.sampling.num_sequences = rng.choice([2, 3])
    if rng.random() < 0.3:
        for text in rng.sample([".", "\n", " the", "3", "\U0001f600"], 2):
            request.stopping.conditions.add(stop_text=text)
        request.stopping.include_stop_in_output = rng.random() < 0.5
    if rng.random() < 0.3:
        request.response.return_output_logprobs = True
        request.response.output_candidates.top_n = rng.choice([0, 3])
    guide = rng.random()
    if guide < 0.1:
        request.guided.regex = r"[a-z]{2,6}( [a-z]{2,6}){0,2}\."
    elif guide < 0.2:
        request.guided.choice.choices.extend(["yes", "no", "maybe"])
    if rng.random() < 0.2:
        request.kv.cache_salt = rng.choice(["a", "b"])
    return request


def run_one(address: str, request: oe.GenerateRequest, fate: str, rng: random.Random) -> Outcome:
    stream = Stream()
    cancel_after = rng.randint(1, 3)
    with OpenEngineClient(address) as client:
        if fate == "abort":  # from another connection, while the stream runs (or after it ended)
            threading.Timer(rng.uniform(0.0, 0.3), lambda: _abort(address, request.request_id)).start()
        events = client.generate(request, timeout=rng.uniform(0.05, 0.4) if fate == "deadline" else 120)
        try:
            for event in events:
                stream.events.append(event)
                if fate == "cancel" and len(stream.events) >= cancel_after:
                    events.close()  # A5: the client goes away mid-stream
                    break
        except grpc.RpcError as exc:
            stream.code, stream.details = exc.code(), exc.details()
    return Outcome(request, fate, stream)


def _abort(address: str, request_id: str) -> None:
    with OpenEngineClient(address) as client:
        try:
            client.abort(request_id)
        except grpc.RpcError as exc:  # it ended before the abort came: nothing to abort
            assert exc.code() == grpc.StatusCode.NOT_FOUND, exc.details()


def check(outcome: Outcome) -> None:
    stream, fate = outcome.stream, outcome.fate
    if fate == "cancel" and stream.code == grpc.StatusCode.OK and not _ended(stream):
        return  # left mid-stream: what was read is all there is to check
    if fate == "deadline" and stream.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        assert not stream.of("error"), "a deadline is a transport end: no EngineError (X1)"
        return
    check_stream(stream, outcome.request)
    if fate != "abort":
        assert all(f.reason != oe.FINISH_REASON_CANCELLED for f in stream.of("finished")), stream.events[-1]


def _ended(stream: Stream) -> bool:
    return bool(stream.events) and stream.events[-1].HasField("usage")


def test_concurrent_streams_ending_every_way_keep_the_invariants_and_leak_nothing(
        client: OpenEngineClient, server_address: str) -> None:
    wait_idle(client)
    rng = random.Random(2026_12_07)
    plans = [(random_request(rng, i), rng.choice(FATES), random.Random(i)) for i in range(NUM_REQUESTS)]
    with ThreadPoolExecutor(NUM_CLIENTS) as pool:
        outcomes = list(pool.map(lambda plan: run_one(server_address, *plan), plans))
    for outcome in outcomes:
        check(outcome)
    assert {o.fate for o in outcomes} == set(FATES)
    assert any(f.reason == oe.FINISH_REASON_CANCELLED for o in outcomes for f in o.stream.of("finished")), \
        "no Abort reached a running stream: the test lost its point"
    time.sleep(0.5)  # the abort timers of streams that ended first
    load = wait_idle(client)
    assert load.active_kv_sessions == 0
    assert load.attributes.fields["open_streams"].number_value == 0
