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


@pytest.mark.parametrize(("logprobs_and_ranks", "ok"), [
    ([(-0.1, 1), (-2.0, 2), (-3.0, 3)], True),
    ([(-1.0, 1), (-1.0, 1), (-3.0, 3)], True),  # a tie shares rank 1
    ([(-1.0, 1), (-1.0, 2), (-3.0, 3)], True),  # or is ranked in order
    ([(-0.1, 1), (-3.0, 3)], False),  # rank 2 left out: not the top 2 (it passed, found by review)
    ([(-0.1, 1), (-0.1, 1), (-0.1, 1)], True),
    ([(-0.1, 1), (-2.0, 1), (-3.0, 1)], False),
])
def test_l4_top_n_candidates_are_the_top_ones(logprobs_and_ranks: list, ok: bool) -> None:
    from refengine.conformance.checks_logprobs import _check_top
    from refengine.conformance.registry import CheckFailed

    cands = [oe.LogProb(token_id=i, logprob=lp, rank=rank) for i, (lp, rank) in enumerate(logprobs_and_ranks)]
    if ok:
        _check_top(cands, "top_n")
    else:
        with pytest.raises(CheckFailed, match="top candidates are not all there"):
            _check_top(cands, "top_n")


def _leak_stop_token_text(request: Any, events: Any) -> Any:
    """G14 broken: a matched stop token is out of the tokens, its text still sent."""
    for event in events:
        finish = event.finished if event.WhichOneof("event") == "finished" else None
        if (finish is not None and finish.stop_match.WhichOneof("match") == "stop_token_id"
                and not request.stopping.include_stop_in_output and 0 <= finish.stop_match.stop_token_id < 128):
            leak = oe.GenerateResponse(request_id=event.request_id)
            leak.token.output_index = finish.output_index
            leak.token.text = chr(finish.stop_match.stop_token_id)
            yield leak
        yield event


def _drop_stop_token_text(request: Any, events: Any) -> Any:
    """G14 broken: with include_stop_in_output the stop token is kept, its text dropped."""
    stops = {c.stop_token_id for c in request.stopping.conditions if c.WhichOneof("condition") == "stop_token_id"}
    for event in events:
        token = event.token if event.WhichOneof("event") == "token" else None
        if (request.stopping.include_stop_in_output and token is not None and token.tokens
                and token.tokens[-1].token_id in stops and token.text.endswith(chr(token.tokens[-1].token_id))):
            token.text = token.text[:-1]
        yield event


@pytest.mark.parametrize(("mutate", "verdict"), [(None, "pass"), (_leak_stop_token_text, "fail"),
                                                 (_drop_stop_token_text, "fail")])
def test_g14_the_stop_tokens_text_follows_the_token(mutate: Any, verdict: str) -> None:
    """Only the tokens were compared, and the text as a prefix of the reference: a server that kept
    a stop token's text after dropping the token, or the reverse, passed (found by review)."""
    from refengine.conformance import run
    from tests.conformance import fake_server
    from tests.conformance.toy_engine import ToyEngine
    from tests.conformance.toy_faults import Faults

    engine = ToyEngine(Faults())
    inner = fake_server.Inference(engine)

    class Mutated(oe.InferenceServicer):
        def Generate(self, request: Any, context: Any) -> Any:  # noqa: N802
            events = inner.Generate(request, context)
            yield from (events if mutate is None else mutate(request, events))

    server, address = fake_server.start(engine, Mutated(), fake_server.Control(engine))
    try:
        results = run(address, ["G14"], Options(idle_timeout_s=3.0))
        (result,) = [r for r in results if r.name.endswith("stop_token_excluded")]
    finally:
        server.stop(0)
        engine.running = False
    assert result.status.value == verdict, result.message
