"""Check verdicts on scripted servers that the release allows to behave unusually, or that break a
rule in a way a check once missed (found by review, each case failed before its fix): a check must
fail only a rule the release states, and must not pass what it could not observe.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import grpc
import pytest

from refengine.conformance import checks_abort, checks_discovery, checks_errors, checks_health
from refengine.conformance.registry import CheckSkipped
from refengine.conformance.target import Options
from refengine.protocol import oe
from tests.conformance.test_check_logic import ScriptedTarget, _finished_stream, _stream


def test_d4_a_token_ids_only_server_refusing_text_passes() -> None:
    """D4: the text probe of a server without text input is a text prompt (``request`` sent
    token ids instead, which that server rightly accepted: a false failure)."""
    def answer(req: Any) -> Any:
        if req.WhichOneof("input") == "prompt":
            return _stream(req, code=grpc.StatusCode.INVALID_ARGUMENT)
        return None

    t = ScriptedTarget("D4", answer)
    t.model_info = oe.ModelInfo(served_model_name="toy", supports_text_input=False, supports_token_ids_input=True)
    try:
        assert checks_discovery.caps_inputs(t) == "text=False token_ids=True"
        assert [r.WhichOneof("input") for r in t.sent][0] == "prompt"
    finally:
        t.close()


class _HealthTarget(ScriptedTarget):
    """Health names its probe ``InferenceProbe``, in place of its one check."""

    def unary(self, method: str, request: Any, metadata: Any = None) -> Any:
        assert method == "Health", method
        name = "InferenceProbe" if request.include_inference_probe else "Engine"
        return oe.HealthResponse(state=oe.HEALTH_STATE_READY,
                                 checks=[oe.HealthCheck(name=name, state=oe.HEALTH_STATE_READY)])


def test_h2_how_a_probe_is_reported_is_the_servers_choice() -> None:
    t = _HealthTarget("H2")
    try:
        assert "a probe check is shown" in checks_health.inference_probe(t)
    finally:
        t.close()


class _DeadlineCall:
    """A stream of one event that then outlives the client's deadline."""

    def __init__(self, first: Any) -> None:
        self.events = [first]

    def __iter__(self) -> _DeadlineCall:
        return self

    def __next__(self) -> Any:
        if self.events:
            return self.events.pop()
        raise _Deadline()

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return "Deadline Exceeded"


class _Deadline(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return "Deadline Exceeded"


def test_x1_the_clients_own_deadline_is_no_finding() -> None:
    """X1: a server that buffers a stalled stream and is then slower than the client's deadline
    provoked no failure: skipped (it failed, as a stream ended neither OK nor by EngineError)."""
    t = ScriptedTarget("X1", options=Options(idle_timeout_s=0.1, slow_reader_s=0.01))
    first = _finished_stream(oe.GenerateRequest(request_id="x"), "X1").events[0]
    stub = types.SimpleNamespace(Generate=lambda req, timeout=None: _DeadlineCall(first))
    t.fixed_window_inference = lambda: contextlib.nullcontext(stub)
    try:
        with pytest.raises(CheckSkipped, match="outlived this client's"):
            checks_errors.error_after_acceptance(t)
    finally:
        t.close()


class _CountlessLoad(ScriptedTarget):
    """GetLoad answers, with every scalar absent (unavailable, H4)."""

    def __init__(self, rule: str) -> None:
        super().__init__(rule)
        self.load_code = grpc.StatusCode.OK

    def load(self, per_rank: bool = False) -> Any:
        return oe.LoadInfo(instance_id="i0")


class _EndlessCall:
    """A stream the server never ends (it does not abort on disconnect)."""

    def __init__(self, req: Any) -> None:
        self.req = req

    def __iter__(self) -> _EndlessCall:
        return self

    def __next__(self) -> Any:
        return oe.GenerateResponse(request_id=self.req.request_id, token=oe.TokenOutput(
            output_index=0, tokens=[oe.TokenInfo(token_id=65, token="A")], text="A"))


def test_a5_without_request_counts_the_release_is_not_observed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A5: absent counts read as 0 made every load look idle, so a server that never aborts on
    disconnect passed; without the counts the release cannot be seen: skipped."""
    monkeypatch.setattr(oe, "InferenceStub", lambda channel: types.SimpleNamespace(
        Generate=lambda req, timeout=None: _EndlessCall(req)))
    t = _CountlessLoad("A5")
    try:
        with pytest.raises(CheckSkipped, match="does not report running_requests or queued_requests"):
            checks_abort.client_disconnect(t)
    finally:
        t.close()
