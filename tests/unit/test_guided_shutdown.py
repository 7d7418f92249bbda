"""A guided request whose acceptance races ``Engine.shutdown`` is refused as a stopped engine
(``EngineStoppedError``: UNAVAILABLE), not with a bare RuntimeError from the closed compile pool
(INTERNAL). Found by review."""

from __future__ import annotations

import threading

from refengine.types import EngineStoppedError, GuidedSpec
from tests.unit.test_guided_engine import make_engine, prompt, request, tiny  # noqa: F401 - tiny: a fixture


def test_a_guided_add_racing_shutdown_is_refused_as_stopped(tiny) -> None:  # noqa: F811
    """add_request passed its room check, then shutdown ran while it tokenized: the compile that
    follows meets the closed compile pool."""
    engine = make_engine(tiny)
    real = engine.input_processor.process
    entered, release = threading.Event(), threading.Event()

    def slow_process(params):  # noqa: ANN001, ANN202
        entered.set()
        release.wait(10)
        return real(params)

    engine.input_processor.process = slow_process
    caught: list[BaseException] = []

    def add() -> None:
        try:
            engine.add_request(request("r", GuidedSpec("regex", "[a-c]{3}"), prompt(1, 5)))
        except BaseException as exc:  # noqa: BLE001
            caught.append(exc)

    thread = threading.Thread(target=add)
    thread.start()
    assert entered.wait(10)
    engine.shutdown()
    release.set()
    thread.join(10)
    assert isinstance(caught[0], EngineStoppedError), caught
