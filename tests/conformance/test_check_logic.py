"""Checks of sections G and X run against a scripted stand-in for the target (no server): each
test gives a check the exact answers a server could send, legal or not, and asserts the check
passes what the contract allows and fails what it forbids, where a toy server would need a
fault of its own for every such answer."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from refengine.conformance.checks_errors import error_after_acceptance, error_before_and_after_acceptance
from refengine.conformance.checks_generate import extra_struct
from refengine.conformance.checks_guided import guided_backend_without_guide, guided_invalid_spec_refused
from refengine.conformance.checks_logprobs import _expect_own_candidate
from refengine.conformance.registry import CheckFailed, CheckSkipped
from refengine.conformance.streams import StreamResult
from refengine.conformance.target import Options, Target
from refengine.protocol import oe

Answer = Callable[[Any], StreamResult]


def _stream(req: Any, *events: Any, code: grpc.StatusCode = grpc.StatusCode.OK, rule: str = "") -> StreamResult:
    return StreamResult(request_id=req.request_id, rule=rule, events=list(events), code=code)


def _finished_stream(req: Any, rule: str) -> StreamResult:
    """A conforming stream: one delta, then the finish with usage."""
    token = oe.GenerateResponse(request_id=req.request_id, token=oe.TokenOutput(
        output_index=0, tokens=[oe.TokenInfo(token_id=65, token="A")], text="A"))
    fin = oe.GenerateResponse(request_id=req.request_id, finished=oe.GenerationFinished(
        output_index=0, reason=oe.FINISH_REASON_LENGTH))
    fin.usage.CopyFrom(oe.Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2))
    return _stream(req, token, fin, rule=rule)


def _error(req: Any) -> Any:
    return oe.GenerateResponse(request_id=req.request_id, error=oe.EngineError(
        code=oe.ERROR_CODE_INVALID_ARGUMENT, message="token id out of vocabulary"))


class ScriptedTarget(Target):
    """A Target whose Generate answers come from ``answer`` (None: a conforming finished stream)
    and whose Control calls are not made; discovery is a text model without limits."""

    def __init__(self, rule: str, answer: Answer | None = None, options: Options | None = None) -> None:
        super().__init__("127.0.0.1:9", options or Options(idle_timeout_s=0.1))
        self.rule = rule
        self.answer = answer
        self.model_info = oe.ModelInfo(served_model_name="toy")
        self.load_code = grpc.StatusCode.UNIMPLEMENTED  # no GetLoad: wait_idle returns at once
        self.sent: list[Any] = []

    def generate(self, req: Any, metadata: Any = None, timeout: float | None = None,
                 on_event: Any = None) -> StreamResult:
        self.sent.append(req)
        res = self.answer(req) if self.answer else None
        if res is None:
            res = _finished_stream(req, self.rule)
        res.rule, res.check, res.ledger = self.rule, self.check, self.ledger
        for event in res.events:
            self.observe(event)
        return res

    def abort(self, request_id: str) -> grpc.StatusCode:
        return grpc.StatusCode.OK


def _refuse_invalid(token_answer: Answer) -> Answer:
    """Refuse G1/G3/G5's invalid requests before acceptance; ``token_answer`` for the request
    carrying the out-of-vocabulary token id; every other request runs normally."""
    def answer(req: Any) -> StreamResult | None:
        if req.WhichOneof("input") is None or req.model != "toy" or req.sampling.temperature < 0:
            return _stream(req, code=grpc.StatusCode.INVALID_ARGUMENT)
        if list(req.token_ids.ids) == [0xFFFFFFFF]:
            return token_answer(req)
        return None
    return answer


@pytest.mark.parametrize(
    ("token_answer", "passes"),
    [
        (lambda req: _stream(req, code=grpc.StatusCode.INVALID_ARGUMENT), True),  # refused before acceptance
        (lambda req: _stream(req, _error(req)), True),  # accepted, then one EngineError and OK (X1 allows it)
        (lambda req: _stream(req, _error(req), _error(req)), False),  # an event after the EngineError
        (lambda req: _stream(req, _error(req), code=grpc.StatusCode.INTERNAL), False),  # EngineError, then non-OK
        (lambda req: _stream(req, _finished_stream(req, "").events[0], code=grpc.StatusCode.INTERNAL), False),
    ],
    ids=["refused", "engine-error-after-acceptance", "event-after-error", "status-after-error", "status-after-token"],
)
def test_x1_out_of_vocabulary_token_may_fail_after_acceptance(token_answer: Answer, passes: bool) -> None:
    t = ScriptedTarget("X1", _refuse_invalid(token_answer))
    try:
        if passes:
            assert "refusals with zero events" in error_before_and_after_acceptance(t)
        else:
            with pytest.raises(CheckFailed):
                error_before_and_after_acceptance(t)
    finally:
        t.close()


class _EmptyCall:
    """A Generate call that ends OK at once, without any event."""

    def __iter__(self) -> _EmptyCall:
        return self

    def __next__(self) -> Any:
        raise StopIteration

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.OK

    def details(self) -> str:
        return ""


def test_x1_stalled_stream_without_events_is_skipped_not_a_crash() -> None:
    """An OK stream with no event at all is G12's finding: the X1 stall check skips, instead of
    failing X1 with a StopIteration."""
    t = ScriptedTarget("X1", options=Options(idle_timeout_s=0.1, slow_reader_s=0.01))
    stub = type("Stub", (), {"Generate": staticmethod(lambda req, timeout=None: _EmptyCall())})()
    t.fixed_window_inference = lambda: contextlib.nullcontext(stub)
    try:
        with pytest.raises(CheckSkipped, match="without any event"):
            error_after_acceptance(t)
    finally:
        t.close()


def _typed_extra(kind: str) -> Answer:
    """A server refusing any value of ``knob`` that is not of JSON type ``kind``."""
    types = {"number": (int, float), "string": (str,), "boolean": (bool,), "array": (list,), "object": (dict,)}

    def answer(req: Any) -> StreamResult | None:
        if "knob" in req.extra:
            value = req.extra["knob"]
            ok = isinstance(value, types[kind]) and not (kind == "number" and isinstance(value, bool))
            if not ok:
                return _stream(req, code=grpc.StatusCode.INVALID_ARGUMENT)
        return None
    return answer


@pytest.mark.parametrize("kind", ["boolean", "array", "object"])
def test_g8_json_schema_type_names_are_type_checked(kind: str) -> None:
    """JSON Schema's names (boolean, array, object) are probed like bool, list, struct: a key
    advertised with one is sent a wrong-typed value, not silently counted as checked."""
    t = ScriptedTarget("G8", _typed_extra(kind), Options(idle_timeout_s=0.1, known_extra_keys={"knob": kind}))
    try:
        assert extra_struct(t).startswith("1 of 1 known keys type-checked")
        assert any("knob" in r.extra for r in t.sent)
    finally:
        t.close()


def test_g8_wrong_type_accepted_fails() -> None:
    t = ScriptedTarget("G8", None, Options(idle_timeout_s=0.1, known_extra_keys={"knob": "boolean"}))
    try:
        with pytest.raises(CheckFailed, match="extra.knob"):
            extra_struct(t)
    finally:
        t.close()


def test_g8_unknown_type_name_is_not_counted_as_checked() -> None:
    t = ScriptedTarget("G8", None, Options(idle_timeout_s=0.1, known_extra_keys={"knob": "uuid"}))
    try:
        note = extra_struct(t)
        assert note.startswith("0 of 1 known keys type-checked") and "'uuid'" in note, note
    finally:
        t.close()


def _token(req: Any) -> Any:
    return _finished_stream(req, "").events[0]


def _guided_target(rule: str, answer: Answer) -> ScriptedTarget:
    """A ScriptedTarget advertising guided decoding (REGEX) whose guided requests get ``answer``."""
    t = ScriptedTarget(rule, lambda req: answer(req) if req.HasField("guided") else None)
    t.model_info.generation.guided_decoding.supported = True
    t.model_info.generation.guided_decoding.modes.append(oe.GUIDED_DECODING_MODE_REGEX)
    return t


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (lambda req: _stream(req, code=grpc.StatusCode.INVALID_ARGUMENT), "refused before acceptance"),
        (lambda req: None, "run without a constraint"),  # read as no constraint: RULES D4 allows it
        (lambda req: _stream(req, _error(req)), None),  # accepted, then failed
    ],
    ids=["refused", "run-unconstrained", "error-after-acceptance"],
)
def test_d4_backend_without_guide_is_refused_or_run(answer: Answer, says: str | None) -> None:
    t = _guided_target("D4", answer)
    try:
        if says:
            assert says in guided_backend_without_guide(t)
        else:
            with pytest.raises(CheckFailed):
                guided_backend_without_guide(t)
    finally:
        t.close()


@pytest.mark.parametrize(
    ("spec_answer", "form"),
    [
        (lambda req: _stream(req, code=grpc.StatusCode.INVALID_ARGUMENT), "before acceptance, INVALID_ARGUMENT"),
        (lambda req: _stream(req, _error(req)), "after acceptance, EngineError ERROR_CODE_INVALID_ARGUMENT"),
        (lambda req: _stream(req, _token(req), _error(req)), None),  # unguided output before the error
        (lambda req: _stream(req, _error(req), code=grpc.StatusCode.INTERNAL), None),  # EngineError, then non-OK
        (lambda req: None, None),  # accepted and run unguided
    ],
    ids=["refused", "engine-error-after-acceptance", "token-before-error", "status-after-error", "run-unguided"],
)
def test_x1_invalid_guided_spec_may_be_refused_in_either_phase(spec_answer: Answer, form: str | None) -> None:
    """X1 says how a refusal looks before and after acceptance; an engine compiling grammars
    after accepting the request reports a bad spec as one EngineError, then OK (found by review:
    that failed X1)."""
    t = _guided_target("X1", spec_answer)
    try:
        if form:
            assert form in guided_invalid_spec_refused(t)
        else:
            with pytest.raises(CheckFailed):
                guided_invalid_spec_refused(t)
    finally:
        t.close()


def _info(token_id: int, logprob: float, rank: int, candidates: list[tuple[int, float, str]],
          text: str = "t") -> oe.TokenInfo:
    info = oe.TokenInfo(token_id=token_id, token=text, logprob=logprob, rank=rank)
    for candidate_id, candidate_logprob, candidate_text in candidates:
        info.candidates.add(token_id=candidate_id, logprob=candidate_logprob, token=candidate_text)
    return info


@pytest.mark.parametrize(("info", "fails"), [
    (_info(5, -0.1, 1, [(5, -0.1, "t"), (6, -2.0, "u")]), False),  # its own entry agrees
    (_info(7, -3.0, 3, [(5, -0.1, "t"), (6, -2.0, "u")]), False),  # ranked below the top 2: not listed
    (_info(7, -2.0, 3, [(5, -0.1, "t"), (6, -2.0, "u")]), False),  # tied with the last listed
    (_info(5, -2.0, 2, [(6, -0.1, "u"), (5, -0.1, "t")]), True),  # another position's logprob on it
    (_info(5, -0.1, 1, [(6, -0.1, "u"), (8, -2.0, "v")]), True),  # rank 1, yet not among its candidates
    (_info(5, -0.1, 1, [(5, -0.1, "t")], text="q"), True),  # another token's text on it
])
def test_l3_a_token_s_own_candidate_entry_agrees_with_it(info: oe.TokenInfo, fails: bool) -> None:
    """L3 "together" (found by review: logprob data shifted by one position passed every L check)."""
    if fails:
        with pytest.raises(CheckFailed):
            _expect_own_candidate(info, 2, "output token 0")
    else:
        _expect_own_candidate(info, 2, "output token 0")


def _deltas(req: Any, *pieces: tuple[list[str], str]) -> StreamResult:
    """A stream of TokenOutputs (token texts, delta text), then a LENGTH finish with usage."""
    events = [oe.GenerateResponse(request_id=req.request_id, token=oe.TokenOutput(
        output_index=0, tokens=[oe.TokenInfo(token_id=100 + i, token=t) for i, t in enumerate(texts)], text=text))
        for texts, text in pieces]
    fin = oe.GenerateResponse(request_id=req.request_id, finished=oe.GenerationFinished(
        output_index=0, reason=oe.FINISH_REASON_LENGTH))
    count = sum(len(texts) for texts, _ in pieces)
    fin.usage.CopyFrom(oe.Usage(prompt_tokens=1, completion_tokens=count, total_tokens=count + 1))
    return _stream(req, *events, fin)


def test_g11_overlap_is_not_judged_on_an_invalid_byte_run() -> None:
    """A byte-fallback tokenizer renders an invalid run of byte tokens as one U+FFFD per byte while a
    byte token's own text may be a character it completes alone: a false 'deltas overlap' (found by
    review on a LLaVA tokenizer). Overlapping deltas of plain text are still found."""
    from refengine.conformance.assertions import overlapping_outputs

    req = oe.GenerateRequest(request_id="g11")
    byte_run = _deltas(req, (["o", "g"], "og"), (["\u0724", "H"], "\ufffd" * 3 + "H"))
    assert overlapping_outputs(byte_run) == []
    repeated = _deltas(req, (["o", "g"], "og"), (["a", "b"], "gab"))
    assert overlapping_outputs(repeated) == [(0, 1)]
