"""Edges of the CLI's output and of the two-hop client, found by review (each test failed
before its fix): in-process ``--json`` is strict JSON with named candidate fields, a
disaggregated generation abandoned while its PromptOutput is being handled releases the
prefill's KV session, a cancelled prefill is said to be cancelled, a bench length range never
passes uint32, and a console that cannot show a character does not end ``generate`` with a
traceback."""

from __future__ import annotations

import io
import json
import math
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from refengine.bench import UINT32_MAX
from refengine.bench.workload import RequestOptions, random_requests, to_message
from refengine.client import PrefillFailed, generate_disaggregated
from refengine.commands.generate_output import JsonPrinter
from refengine.protocol import oe
from refengine.types.outputs import Candidate, RequestOutput, SequenceDelta, TokenInfo


def _forbidden_candidate_output() -> RequestOutput:
    """A token whose second candidate the grammar forbade: logprob -inf."""
    info = TokenInfo(95, "o", logprob=0.0, rank=1,
                     candidates=(Candidate(95, 0.0, 1, "o"), Candidate(0, -math.inf, 2, "<|endoftext|>")))
    return RequestOutput("cli", deltas=(SequenceDelta(0, (info,), "o"),))


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"not JSON: {name}")


def test_in_process_json_is_strict_json_with_named_candidate_fields(capsys: pytest.CaptureFixture[str]) -> None:
    JsonPrinter().engine(_forbidden_candidate_output())
    line = json.loads(capsys.readouterr().out, parse_constant=_refuse_constant)  # -Infinity was printed bare
    candidates = line["deltas"][0]["tokens"][0]["candidates"]
    assert candidates == [{"token_id": 95, "logprob": 0.0, "rank": 1, "text": "o"},
                          {"token_id": 0, "logprob": "-Infinity", "rank": 2, "text": "<|endoftext|>"}]


class Prefill:
    """A prefill hop that sends a PromptOutput, then PrefillReady; records session aborts."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def generate(self, request: Any, timeout: float | None = None, metadata: Any = None) -> Iterator[Any]:
        yield oe.GenerateResponse(request_id="r", prompt=oe.PromptOutput())
        ready = oe.GenerateResponse(request_id="r")
        ready.prefill_ready.kv_session.session_id = "s1"
        yield ready

    def abort(self, request_id: str | None = None, *, all_requests: bool = False, kv_session: Any = None,
              timeout: float | None = None) -> None:
        self.aborted.append(kv_session.session_id)


class Decode:
    def generate(self, request: Any, timeout: float | None = None, metadata: Any = None) -> Iterator[Any]:
        yield oe.GenerateResponse(request_id="r", token=oe.TokenOutput(output_index=0, text="x"))


@pytest.mark.parametrize("events_taken", [1, 2], ids=["at-the-prompt-output", "during-decode"])
def test_an_abandoned_two_hop_generation_releases_the_session(events_taken: int) -> None:
    prefill = Prefill()
    events = generate_disaggregated(prefill, Decode(), oe.GenerateRequest(request_id="r", prompt="p"))  # type: ignore[arg-type]
    for _ in range(events_taken):
        next(events)
    events.close()  # what the CLI's closing() does on Ctrl-C or a broken pipe
    assert prefill.aborted == ["s1"]


class EndedPrefill:
    """A prefill hop that ends with ``GenerationFinished(reason)`` instead of PrefillReady."""

    def __init__(self, reason: int) -> None:
        self.reason = reason

    def generate(self, request: Any, timeout: float | None = None, metadata: Any = None) -> Iterator[Any]:
        yield oe.GenerateResponse(request_id="r", finished=oe.GenerationFinished(reason=self.reason, message="aborted"))


def test_a_cancelled_prefill_is_said_to_be_cancelled() -> None:
    """Found by a chaos run (an Abort on the prefill server mid-prefill): the prefill ends with
    GenerationFinished(CANCELLED), as A4 asks, and the client said 'not a prefill server'."""
    events = generate_disaggregated(EndedPrefill(oe.FINISH_REASON_CANCELLED), Decode(),  # type: ignore[arg-type]
                                    oe.GenerateRequest(request_id="r", prompt="p"))
    with pytest.raises(PrefillFailed, match="the prefill was cancelled: aborted") as failed:
        next(events)
    assert failed.value.event is not None and failed.value.event.finished.reason == oe.FINISH_REASON_CANCELLED
    with pytest.raises(PrefillFailed, match="not a prefill server"):  # it finished its output: it decoded
        next(generate_disaggregated(EndedPrefill(oe.FINISH_REASON_STOP), Decode(),  # type: ignore[arg-type]
                                    oe.GenerateRequest(request_id="r", prompt="p")))


def test_bench_output_lengths_stay_within_uint32() -> None:
    """--output-len 2^32-1 --range-ratio 0.5: half the requests failed in to_message."""
    requests = random_requests(64, 4, UINT32_MAX, 0.5, seed=1, vocab_size=100)
    assert max(r.output_len for r in requests) <= UINT32_MAX
    options = RequestOptions(model="m")
    assert all(to_message(r, options).stopping.max_tokens == r.output_len for r in requests)


def test_generate_replaces_what_the_console_cannot_encode(monkeypatch: pytest.MonkeyPatch) -> None:
    from refengine.commands.generate import run_generate

    console = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", console)
    run_generate(_args_refused_by_usage())
    print("caf\\u00e9")
    assert console.errors == "replace"


def _args_refused_by_usage() -> Any:
    """Flags that end ``generate`` at once (a usage error), after its console set-up."""
    from refengine.cli import build_parser

    return build_parser().parse_args(["generate", "x", "--prefill", "127.0.0.1:9"])

