"""The run-wide structural checks (G9, G10, G11, G12, G16): run after every other check, each
reports the problems of its rule found in the streams the other checks read (stop strings,
logprobs, guided output, aborts, several outputs, prefix-cache hits ...), which those checks do
not judge (:mod:`stream_ledger`). A run of one rule alone has no other streams: they skip."""

from __future__ import annotations

from refengine.conformance.registry import check, fail, skip
from refengine.conformance.target import Target

SHOWN = 3  # findings quoted in a failure message; the count says how many there were


def judge_other_streams(t: Target, rule: str) -> str:
    """Fail with the first findings of ``rule`` in the other checks' streams; pass when none."""
    streams = t.ledger.streams_for(rule)
    if not streams:
        skip(f"no complete stream of another check was read in this run: nothing to judge {rule} on")
    found = t.ledger.findings_for(rule)
    if found:
        quoted = "; ".join(f"{f.check} (request {f.request_id!r}): {f.problem}" for f in found[:SHOWN])
        more = f" (and {len(found) - SHOWN} more)" if len(found) > SHOWN else ""
        fail(f"{len(found)} problem(s) in {streams} streams of other checks: {quoted}{more}")
    return f"{streams} streams of other checks conform"


@check("G9", "every stream of the run echoes its request_id", run_last=True)
def every_stream_echoes_request_id(t: Target) -> str:
    return judge_other_streams(t, "G9")


@check("G10", "every stream of the run carries output_index in range", run_last=True)
def every_stream_indexes_outputs(t: Target) -> str:
    return judge_other_streams(t, "G10")


@check("G11", "every stream of the run sends text deltas, not cumulative text", run_last=True)
def every_stream_sends_deltas(t: Target) -> str:
    return judge_other_streams(t, "G11")


@check("G12", "every stream of the run: one GenerationFinished per output, nothing after it", run_last=True)
def every_stream_finishes_once(t: Target) -> str:
    return judge_other_streams(t, "G12")


@check("G16", "every stream of the run: Usage on the final response only, consistent", run_last=True)
def every_stream_has_final_usage(t: Target) -> str:
    return judge_other_streams(t, "G16")
