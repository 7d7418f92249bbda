"""A step that fails while handing its new requests to the core (an engine fault): every request
the step took ends with one terminal error, also those after the failing one, which the core never
got (before, their streams waited forever and their ids stayed in use), the load figures forget
them (before, GetLoad counted them as waiting until the next request), and the engine serves on."""

from __future__ import annotations

import pytest

from refengine.engine.engine import Engine
from tests.unit.test_engine import assert_idle, greedy, make_engine, prompt, tiny  # noqa: F401 - tiny: a fixture


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
