"""Faults around a step. A step that fails while handing its new requests to the core: every request
the step took ends with one terminal error, also those after the failing one, which the core never
got (before, their streams waited forever and their ids stayed in use), the load figures forget
them (before, GetLoad counted them as waiting until the next request), and the engine serves on.
A KV event sink or the debug integrity check failing after a step: its finished requests still end."""

from __future__ import annotations

from dataclasses import replace

import pytest

from refengine.config import CacheConfig, EngineConfig, SchedulerConfig
from refengine.engine.engine import Engine
from refengine.types import OverloadedError
from tests.unit.test_engine import TOKENIZER, assert_idle, greedy, make_engine, prompt, tiny  # noqa: F401 - tiny: a fixture


def test_requests_after_one_the_core_refused_end_too(tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    engine: Engine = make_engine(tiny)
    add = engine.core.add_request

    def add_or_fail(request) -> None:  # noqa: ANN001
        if request.request_id == "b":
            raise RuntimeError("injected")
        add(request)

    monkeypatch.setattr(engine.core, "add_request", add_or_fail)
    streams = [engine.add_request(greedy(rid, prompt(i, 9))) for i, rid in enumerate("abc")]  # one step takes all
    engine.start()
    try:
        for stream in streams:
            completion = stream.result(timeout=30)
            assert completion.error is not None and "RuntimeError: injected" in completion.error.message
            assert completion.usage.prompt_tokens == 9
        load = engine.stats()  # what GetLoad reports: the failed step's requests are gone
        assert (load.waiting_requests, load.running_requests, load.used_kv_blocks) == (0, 0, 0), load
        monkeypatch.setattr(engine.core, "add_request", add)
        again = engine.add_request(greedy("c", prompt(3, 9), max_tokens=4)).result(timeout=30)  # "c" is free again
        assert again.error is None and len(again.outputs[0].token_ids) == 4
        assert not engine.has_unfinished_requests
        assert_idle(engine)
    finally:
        engine.shutdown()


def test_a_failing_kv_event_sink_loses_no_request_s_end(tiny, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    """Found by review: the sink runs after the step retired its finished requests; when it
    raised, their outputs were never delivered, their streams never ended and their ids stayed
    in use. An observer's failure is now logged, and the request ends normally."""
    _, config, weights = tiny
    failing = {"on": True}

    def sink(events) -> None:  # noqa: ANN001
        if failing["on"]:
            raise RuntimeError("observer broke")

    engine = Engine(EngineConfig(max_model_len=256, cache=CacheConfig(block_size=4, num_blocks=256),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=32)),
                    config, weights, TOKENIZER, model_fingerprint="tiny", kv_event_sink=sink)
    stream = engine.add_request(greedy("a", prompt(0, 8), max_tokens=1))  # ends in its first step
    engine.start()
    try:
        completion = stream.result(timeout=30)
        assert completion.error is None and len(completion.outputs[0].token_ids) == 1
        assert not engine.has_unfinished_requests
        assert "publishing" in caplog.text and "observer broke" in caplog.text
    finally:
        engine.shutdown()


def test_a_failing_integrity_check_loses_no_request_s_end(tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """--debug-kv-integrity: the check ran inside the step, after its finished requests were
    retired; when it failed, their ends were lost, and the loop failed every later step."""
    engine = make_engine(tiny)
    engine.config = engine.core.config = replace(engine.config, debug_kv_integrity=True)

    def broken() -> None:
        raise AssertionError("integrity")

    monkeypatch.setattr(engine.core, "check_idle", broken)
    stream = engine.add_request(greedy("x", prompt(0, 6), max_tokens=1))
    engine.start()
    try:
        completion = stream.result(timeout=30)
        assert completion.error is None and len(completion.outputs[0].token_ids) == 1
        assert not engine.has_unfinished_requests
    finally:
        engine.shutdown()


def test_a_fault_while_ending_the_requests_after_a_fault_still_ends_them(tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811, E501
    """Found by review: the loop ran ``fail_all`` unguarded, so a second fault inside it killed the
    step loop silently; every client then waited forever and new requests were accepted and never
    served. Now each stream ends with one terminal error and the engine stops, refusing new work."""
    engine = make_engine(tiny)

    def broken_step(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        raise RuntimeError("injected step fault")

    finish = engine.core.scheduler.finish
    calls = []

    def finish_once_broken(seq) -> None:  # noqa: ANN001
        calls.append(seq)
        if len(calls) == 1:
            raise ValueError("list.remove(x): x not in list")
        finish(seq)

    monkeypatch.setattr(engine.core.runner, "execute", broken_step)
    monkeypatch.setattr(engine.core.scheduler, "finish", finish_once_broken)
    stream = engine.add_request(greedy("x", prompt(0, 6), max_tokens=4))
    engine.start()
    try:
        completion = stream.result(timeout=30)
        assert completion.error is not None and "the engine stopped" in completion.error.message
        with pytest.raises(OverloadedError, match="shut down"):
            engine.add_request(greedy("y", prompt(1, 6), max_tokens=2))
    finally:
        engine.shutdown()
