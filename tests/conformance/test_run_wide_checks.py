"""The run-wide structural checks (checks_structure, fed by stream_ledger) and G13's check of
the EOS token an output names, against scripted answers (test_check_logic.ScriptedTarget): what
the contract allows passes, what it forbids fails, what cannot be told skips."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from refengine.conformance.assertions import expect_valid
from refengine.conformance.checks_output import finish_eos_match
from refengine.conformance.checks_structure import every_stream_finishes_once, every_stream_has_final_usage
from refengine.conformance.registry import CheckFailed, CheckSkipped, all_checks
from refengine.protocol import oe
from tests.conformance.test_check_logic import ScriptedTarget, _finished_stream, _stream

EOS = 2


def _twice_finished(req: Any, rule: str) -> Any:
    """A stream whose one output finishes twice (G12), the second finish carrying the usage."""
    res = _finished_stream(req, rule)
    res.events.insert(1, oe.GenerateResponse(request_id=req.request_id, finished=oe.GenerationFinished(
        output_index=0, reason=oe.FINISH_REASON_LENGTH)))
    return res


def test_a_structural_problem_in_another_rules_stream_fails_its_own_rule_at_the_end() -> None:
    """Before: G14's check skipped on the unreadable stream and G12's plain streams were fine,
    so the server passed G12."""
    t = ScriptedTarget("G14", answer=lambda req: _twice_finished(req, "G14"))
    t.check = "G14:some_check"
    req = t.request("g14")
    with pytest.raises(CheckSkipped, match="G12 fails for it"):
        expect_valid(t.generate(req))
    t.rule = "G12"
    with pytest.raises(CheckFailed, match=f"G14:some_check \\(request '{req.request_id}'\\).*after its"):
        every_stream_finishes_once(t)
    assert every_stream_has_final_usage(t) == "1 streams of other checks conform"


def test_the_rule_s_own_streams_and_cut_streams_are_not_judged_again() -> None:
    own = ScriptedTarget("G12", answer=lambda req: _twice_finished(req, "G12"))
    with pytest.raises(CheckFailed):
        expect_valid(own.generate(own.request("g12")))
    with pytest.raises(CheckSkipped, match="no complete stream of another check"):
        every_stream_finishes_once(own)
    cut = ScriptedTarget("A5", answer=lambda req: _stream(req, *_twice_finished(req, "A5").events[:2],
                                                          code=grpc.StatusCode.CANCELLED))
    cut.ledger.record(cut.generate(cut.request("a5")), ["G12: output 0 finished twice"])
    with pytest.raises(CheckSkipped):
        every_stream_finishes_once(cut)


def test_a_stream_read_twice_is_recorded_once() -> None:
    t = ScriptedTarget("G14", answer=lambda req: _twice_finished(req, "G14"))
    res = t.generate(t.request("g14"))
    for _ in range(2):
        with pytest.raises(CheckSkipped):
            expect_valid(res)
    assert t.ledger.streams_for("G12") == 1 and len(t.ledger.findings_for("G12")) == 1


def test_the_run_wide_checks_run_after_every_other_check() -> None:
    order = [c.run_last for c in all_checks()]
    assert order == sorted(order) and order.count(True) == 5


def _eos_answer(named: int, through: list[int], rank: int | None) -> Any:
    """A server whose greedy outputs stop at EOS after [65, 66] naming ``named``; with
    ignore_eos it produces ``through``; prompt logprobs (when ``rank`` is set) rank the last
    token sent as ids ``rank``."""
    def answer(req: Any) -> Any:
        events = []
        if req.response.return_prompt_logprobs:
            ids = list(req.token_ids.ids) or [1, 5, 9]
            infos = [oe.TokenInfo(token_id=i, rank=rank) for i in ids]
            events.append(oe.GenerateResponse(request_id=req.request_id, prompt=oe.PromptOutput(tokens=infos)))
        tokens = through if req.stopping.ignore_eos else [65, 66]
        tokens = tokens[:req.stopping.max_tokens]
        events.append(oe.GenerateResponse(request_id=req.request_id, token=oe.TokenOutput(
            output_index=0, tokens=[oe.TokenInfo(token_id=i) for i in tokens])))
        fin = oe.GenerationFinished(output_index=0, reason=oe.FINISH_REASON_LENGTH)
        if not req.stopping.ignore_eos and not req.response.return_prompt_logprobs:
            fin.reason, fin.stop_match.eos_token_id = oe.FINISH_REASON_STOP, named
        events.append(oe.GenerateResponse(request_id=req.request_id, finished=fin))
        events[-1].usage.CopyFrom(oe.Usage(prompt_tokens=3, completion_tokens=len(tokens),
                                           total_tokens=3 + len(tokens)))
        return _stream(req, *events)
    return answer


def _eos_target(named: int, through: list[int], rank: int | None) -> ScriptedTarget:
    t = ScriptedTarget("G13", answer=_eos_answer(named, through, rank))
    if rank is not None:
        t.model_info.supports_token_ids_input = True
        t.model_info.generation.prompt_logprobs.supported = True
    return t


@pytest.mark.parametrize(
    ("named", "through", "rank", "outcome"),
    [
        (EOS, [65, 66, EOS], None, "pass"),  # with ignore_eos the model goes on through the EOS named
        (7, [65, 66, EOS], 4, "fail"),  # a wrong name: the token named ranks 4th where greedy chose EOS
        (EOS, [65, 66, 67], 1, "pass"),  # EOS masked under ignore_eos; the name ranks first there
        (EOS, [65, 66, 67], None, "skip"),  # masked, and no prompt logprobs to tell
        (EOS, [65, 67, 68], None, "skip"),  # greedy output not reproduced: G18's finding, not G13's
    ],
    ids=["named-right", "named-wrong", "masked-named-right", "masked-untold", "not-reproduced"],
)
def test_g13_eos_match_names_the_token_the_output_stopped_at(named: int, through: list[int], rank: int | None,
                                                             outcome: str) -> None:
    t = _eos_target(named, through, rank)
    if outcome == "pass":
        assert "matched" in finish_eos_match(t)
    else:
        with pytest.raises(CheckFailed if outcome == "fail" else CheckSkipped):
            finish_eos_match(t)
