"""``Engine.shutdown`` with requests still active (found by review): they were left as they
were, so an in-process caller waited on them forever, and a request added afterwards was
accepted and never served. Now each ends with one terminal error, its KV freed, and a later
``add_request`` is refused (EngineStoppedError, an OverloadedError). A shut-down engine cannot
start again: its worker pools are closed (found by review: a restarted one failed every guided
request with "the guide compiler is closed")."""

from __future__ import annotations

import time

import pytest

from refengine.types import EngineStoppedError
from tests.unit.test_engine import greedy, make_engine, prompt, tiny  # noqa: F401 - tiny: a fixture


def test_shutdown_ends_running_and_queued_requests_and_refuses_new_ones(tiny) -> None:  # noqa: F811
    engine = make_engine(tiny)
    running = engine.add_request(greedy("running", prompt(0, 8), max_tokens=200))
    engine.start()
    deadline = time.monotonic() + 30
    while engine.stats().running_requests == 0:  # until it is being computed
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.01)
    engine.shutdown()
    queued = engine.add_request  # after shutdown: refused, nothing accepted
    with pytest.raises(EngineStoppedError, match="shut down"):
        queued(greedy("late", prompt(1, 8), max_tokens=4))
    completion = running.result(timeout=5)
    assert completion.error is not None and "shut down" in completion.error.message
    assert not engine.has_unfinished_requests
    assert engine.core.pool.num_used == 0
    with pytest.raises(EngineStoppedError, match="cannot be restarted"):
        engine.start()
    with pytest.raises(EngineStoppedError, match="shut down"):
        engine.add_request(greedy("again", prompt(2, 8), max_tokens=3))


def test_shutdown_ends_requests_no_step_took_yet(tiny) -> None:  # noqa: F811
    engine = make_engine(tiny)  # never started: nothing steps
    waiting = engine.add_request(greedy("waiting", prompt(3, 8), max_tokens=4))
    engine.shutdown()
    completion = waiting.result(timeout=5)
    assert completion.error is not None and "shut down" in completion.error.message
    assert not engine.has_unfinished_requests


def test_a_stopped_engine_s_health_probe_is_not_ready(tiny) -> None:  # noqa: F811
    """An engine that stopped (shut down, or after a fault it could not end its requests from)
    refuses the probe with EngineStoppedError: NOT_READY, where a busy one is DEGRADED."""
    import asyncio

    from refengine.protocol import oe
    from refengine.server.health import inference_probe

    engine = make_engine(tiny)
    engine.start()
    engine.shutdown()
    check = asyncio.run(inference_probe(engine, timeout=5.0))
    assert check.state == oe.HEALTH_STATE_NOT_READY and "shut down" in check.message, check


def test_health_probes_never_take_a_client_slot(tiny) -> None:  # noqa: F811
    """--max-active-requests is the clients' (found by review: a load balancer's probes of a
    saturated server took client slots, and clients got RESOURCE_EXHAUSTED); probes have
    PROBE_SLOTS of their own beside them."""
    from dataclasses import replace

    from refengine.engine.engine_accept import PROBE_SLOTS
    from refengine.types import OverloadedError

    engine = make_engine(tiny)
    engine.config = replace(engine.config, scheduler=replace(engine.config.scheduler, max_active_requests=2))
    try:
        for i in range(PROBE_SLOTS):  # never started: everything stays active
            engine.add_request(replace(greedy(f"probe-{i}", prompt(i, 4), max_tokens=1), health_probe=True))
        with pytest.raises(OverloadedError, match="health probes"):
            engine.add_request(replace(greedy("probe-extra", prompt(9, 4), max_tokens=1), health_probe=True))
        for i in range(2):
            engine.add_request(greedy(f"client-{i}", prompt(10 + i, 4), max_tokens=1))
        with pytest.raises(OverloadedError, match="too many requests"):
            engine.add_request(greedy("client-extra", prompt(20, 4), max_tokens=1))
    finally:
        engine.shutdown()



def test_a_request_being_accepted_counts_as_active(tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """While ``add_request`` processes a request (tokenizing, compiling its grammar), its id is
    taken (a duplicate is refused), it counts against --max-active-requests, and an abort of it
    is kept: the request is cancelled once it is in (found by review: the abort was lost)."""
    import threading
    from dataclasses import replace

    from refengine.types import DuplicateRequestError, FinishReason, OverloadedError

    engine = make_engine(tiny)
    engine.config = replace(engine.config, scheduler=replace(engine.config.scheduler, max_active_requests=1))
    entered, release = threading.Event(), threading.Event()
    process = engine.input_processor.process

    def slow(params):  # noqa: ANN001, ANN202
        entered.set()
        release.wait(10)
        return process(params)

    monkeypatch.setattr(engine.input_processor, "process", slow)
    streams = []
    adding = threading.Thread(target=lambda: streams.append(engine.add_request(greedy("slow", prompt(0, 8),
                                                                                      max_tokens=50))))
    engine.start()
    try:
        adding.start()
        assert entered.wait(10)
        with pytest.raises(DuplicateRequestError):
            engine.add_request(greedy("slow", prompt(1, 8), max_tokens=1))
        with pytest.raises(OverloadedError):
            engine.add_request(greedy("other", prompt(2, 8), max_tokens=1))
        assert engine.has_unfinished_requests and engine.abort("slow")
        release.set()
        adding.join(10)
        completion = streams[0].result(timeout=30)
        assert completion.outputs[0].finish.reason is FinishReason.CANCELLED
        assert len(completion.outputs[0].token_ids) < 50 and engine.core.pool.num_used == 0
    finally:
        release.set()
        engine.shutdown()
