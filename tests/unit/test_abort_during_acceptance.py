"""Control.Abort of a request still being accepted (``engine_accept.py``'s reservation; A2, A4).

Found by review: an Abort during the acceptance of a reused id answered ALREADY_FINISHED from the
finished namesake, yet cancelled the new request; an Abort of a request then refused during
acceptance waited out the whole abort confirmation (15 s) and answered ABORTED for a request that
never existed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from refengine.protocol import oe
from refengine.server import control
from refengine.server.control import ControlServicer
from refengine.types import FinishReason, InvalidRequestError
from tests.unit.test_engine import greedy, make_engine, prompt, tiny  # noqa: F401 - tiny: a fixture


class AbortedCall(Exception):
    pass


class FakeContext:
    async def abort(self, code, message):  # noqa: ANN001
        raise AbortedCall(code, message)


def gate_processing(engine, fail: bool = False) -> threading.Event:
    """The next add_request blocks in InputProcessor.process (a grammar compiling) until set."""
    gate, real = threading.Event(), engine.input_processor.process

    def slow(params):  # noqa: ANN001, ANN202
        assert gate.wait(30)
        if fail:
            raise InvalidRequestError("the grammar does not compile")
        return real(params)

    engine.input_processor.process = slow
    return gate


def abort_rpc(engine, request_id: str):  # noqa: ANN001, ANN201
    # The server's state as Abort reads it: the engine, and no Generate call waiting to reuse an id.
    state = SimpleNamespace(engine_for_control=lambda: engine, flag_reusing=lambda request_id: False)
    servicer = ControlServicer(state)
    return asyncio.run(servicer.Abort(oe.AbortRequest(request_id=request_id), FakeContext()))


def wait_accepting(engine, request_id: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + 10
    while request_id not in engine._accepting:
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_abort_while_a_reused_id_is_accepted_answers_aborted(tiny) -> None:  # noqa: F811
    engine = make_engine(tiny)
    engine.start()
    try:
        first = engine.add_request(greedy("r1", prompt(0, 8), max_tokens=2)).result(timeout=30)
        assert first.error is None  # "r1" finished normally: _finished_ids["r1"] = False
        gate = gate_processing(engine)
        streams = []
        adder = threading.Thread(target=lambda: streams.append(
            engine.add_request(greedy("r1", prompt(1, 8), max_tokens=50))))
        adder.start()
        wait_accepting(engine, "r1")
        threading.Timer(0.2, gate.set).start()  # accepted while Abort waits: then cancelled at admission
        started = time.monotonic()
        answer = abort_rpc(engine, "r1")
        waited = time.monotonic() - started
        adder.join(10)
        completion = streams[0].result(timeout=30)
    finally:
        engine.shutdown()
    assert completion.outputs[0].finish.reason is FinishReason.CANCELLED, completion.outputs[0].finish
    assert answer.status == oe.ABORT_STATUS_ABORTED, (answer.status, answer.message)
    assert waited < control.ABORT_CONFIRM_SECONDS / 2, "confirmed by the CANCELLED end, not by the timeout"


def test_abort_of_a_request_refused_during_acceptance_does_not_wait_out_the_confirm_timeout(
        tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setattr(control, "ABORT_CONFIRM_SECONDS", 3.0)  # 15 s in the server
    engine = make_engine(tiny)
    engine.start()
    try:
        gate = gate_processing(engine, fail=True)
        refused = []

        def add() -> None:
            try:
                engine.add_request(greedy("r2", prompt(2, 8), max_tokens=50))
            except InvalidRequestError as exc:
                refused.append(exc)

        adder = threading.Thread(target=add)
        adder.start()
        wait_accepting(engine, "r2")
        threading.Timer(0.2, gate.set).start()  # the compile fails while Abort waits
        started = time.monotonic()
        try:
            answer = abort_rpc(engine, "r2")
            outcome = (answer.status, answer.message)
        except AbortedCall as exc:
            outcome = exc.args
        elapsed = time.monotonic() - started
        adder.join(10)
    finally:
        engine.shutdown()
    assert refused, "the add was refused: nothing was ever accepted under r2"
    assert elapsed < 1.5, f"Abort waited the whole confirm timeout ({elapsed:.2f} s) and answered {outcome}"
    assert outcome[0] == grpc.StatusCode.NOT_FOUND, outcome


def test_a_refused_reuse_of_a_finished_id_keeps_it_finished(tiny) -> None:  # noqa: F811
    """A2: a request refused before acceptance never existed; the finished namesake still answers."""
    engine = make_engine(tiny)
    engine.start()
    try:
        assert engine.add_request(greedy("r1", prompt(0, 8), max_tokens=2)).result(timeout=30).error is None
        bad = greedy("r1", prompt(1, 8), max_tokens=2)
        bad.sampling = type(bad.sampling)(temperature=-1.0)
        with pytest.raises(InvalidRequestError):
            engine.add_request(bad)
        answer = abort_rpc(engine, "r1")
    finally:
        engine.shutdown()
    assert answer.status == oe.ABORT_STATUS_ALREADY_FINISHED, (answer.status, answer.message)
