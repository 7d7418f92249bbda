"""The toy engine's requests and what they stream (tests/conformance/toy_engine.py): the jobs
it runs, and the GenerateResponse events it sends for them, each deliberate violation of the
stream rules (G9-G16, L1/L2, A4, X1) switched on by a ``Faults`` field."""

from __future__ import annotations

import queue
import random
import time
from dataclasses import dataclass, field
from typing import Any

import llguidance

from refengine.protocol import oe
from tests.conformance.toy_faults import Faults
from tests.conformance.toy_model import distribution, token_info


@dataclass
class Output:
    index: int
    rng: random.Random
    matcher: llguidance.LLMatcher | None = None
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0  # characters of ``text`` sent
    pending: list[Any] = field(default_factory=list)  # TokenInfo not sent yet
    done: bool = False


@dataclass
class Job:
    req: Any
    prompt: list[int]
    max_tokens: int
    priority: int
    events: queue.Queue
    outputs: list[Output]
    shift: int = 0  # the LoRA adapter's
    cached: int = 0  # prompt tokens served from the prefix cache
    fail_after: int | None = None  # extra "toy_fail_after": shed with an EngineError after that many tokens
    arrival: float = field(default_factory=time.monotonic)
    started: bool = False  # had its first step (prefill)
    cancelled: bool = False

    @property
    def stops(self) -> list[str]:
        return [c.stop_text for c in self.req.stopping.conditions if c.WhichOneof("condition") == "stop_text"]

    @property
    def stop_ids(self) -> set[int]:
        return {c.stop_token_id for c in self.req.stopping.conditions if c.WhichOneof("condition") == "stop_token_id"}

    @property
    def temperature(self) -> float:
        s = self.req.sampling
        return s.temperature if s.HasField("temperature") else 1.0


class Streams:
    """The jobs of an engine and the events of their streams (``ToyEngine`` adds the stepping)."""

    def __init__(self, faults: Faults) -> None:
        self.faults = faults
        self.jobs: dict[str, Job] = {}
        self.finished: set[str] = set()
        self.completed: set[str] = set()  # ids that ended STOP/LENGTH (Faults.ids_kept_after_completion)
        self.ended = 0  # jobs ended in the current step

    # -- events ------------------------------------------------------------------------
    def event(self, job: Job, **body: Any) -> Any:
        ev = oe.GenerateResponse(request_id=job.req.request_id, **body)
        if "finished" in body and self.faults.finish_without_request_id:
            ev.request_id = ""
        if "token" in body and self.faults.token_without_request_id:
            ev.request_id = ""
        return ev

    def emit(self, job: Job, out: Output, upto: int) -> None:
        """A TokenOutput of the tokens not sent yet and their text up to ``upto`` (the rest may
        still become a stop match: held back)."""
        upto = max(upto, out.emitted)
        start = 0 if self.faults.cumulative_text else out.emitted
        if self.faults.overlapping_deltas and out.emitted and upto > out.emitted:
            start -= 1  # the last character of the delta before, again
        token = oe.TokenOutput(tokens=out.pending, text=out.text[start:upto])
        out.pending = []
        if not self.faults.omit_output_index:
            token.output_index = out.index
        out.emitted = upto
        self.put(job, self.event(job, token=token), final=False)

    def held(self, job: Job, out: Output) -> int:
        """G14: how many characters at the end of ``out``'s text may still become a stop match."""
        return max([k for x in job.stops for k in range(1, len(x)) if out.text.endswith(x[:k])], default=0)

    def finish(self, job: Job, out: Output, reason: int, match: Any = None) -> None:
        if out.pending or out.emitted < len(out.text):
            upto = len(out.text)
            if reason == oe.FINISH_REASON_LENGTH and self.faults.length_drops_held_text:
                upto -= self.held(job, out)
            if reason == oe.FINISH_REASON_LENGTH and self.faults.length_drops_last_text:
                upto = len(out.text) - len(out.pending)  # the text of the tokens not sent yet (one character each)
            self.emit(job, out, upto)
        out.done = True
        if reason in (oe.FINISH_REASON_STOP, oe.FINISH_REASON_LENGTH):
            self.completed.add(job.req.request_id)
        last = all(o.done for o in job.outputs)
        if self.faults.omit_finish and reason in (oe.FINISH_REASON_STOP, oe.FINISH_REASON_LENGTH):
            if last:
                self.put(job, self.event(job, token=oe.TokenOutput(output_index=out.index)), final=True)
                self.end(job)
            return
        fin = oe.GenerationFinished(reason=self.faults.finish_reason or reason)
        if not self.faults.omit_output_index:
            fin.output_index = out.index
        if match is not None:
            fin.stop_match.CopyFrom(match)
        if self.faults.double_finish or (self.faults.double_finish_on_stop_text and match is not None
                                         and match.WhichOneof("match") == "stop_text"):
            self.put(job, self.event(job, finished=fin), final=False)
        self.put(job, self.event(job, finished=fin), final=last)
        if last:
            self.end(job)

    def cancel(self, job: Job) -> None:
        """A4: every unfinished output ends CANCELLED (Faults.abort_first_output_only: the first only)."""
        pending = [o for o in job.outputs if not o.done]
        if self.faults.abort_first_output_only:
            for out in pending[1:]:
                out.done = True
            pending = pending[:1]
        for out in pending:
            self.finish(job, out, self.faults.cancel_reason)

    def fail(self, job: Job, code: int, message: str, retryable: bool) -> None:
        """X1: a failure after acceptance is one terminal EngineError (then the stream ends OK)."""
        self.put(job, self.event(job, error=oe.EngineError(code=code, message=message, retryable=retryable)),
                 final=True)
        if self.faults.event_after_error:
            job.events.put(self.event(job, token=oe.TokenOutput(output_index=0, text="!")))
        self.end(job)

    def end(self, job: Job) -> None:
        self.ended += 1
        del self.jobs[job.req.request_id]
        self.finished.add(job.req.request_id)
        job.events.put(None)

    def put(self, job: Job, ev: Any, final: bool) -> None:
        omitted = self.faults.omit_usage or (self.faults.omit_usage_with_logprobs
                                             and job.req.response.return_output_logprobs)
        if (final and not omitted) or self.faults.usage_every_event:
            done = sum(len(o.tokens) for o in job.outputs)
            ev.usage.CopyFrom(oe.Usage(prompt_tokens=len(job.prompt), completion_tokens=done,
                                       total_tokens=len(job.prompt) + done, cached_prompt_tokens=job.cached))
        job.events.put(ev)

    def prompt_output(self, job: Job) -> None:
        """L1/L2: PromptOutput, when asked for, before any token; the first position bare."""
        r, prompt = job.req.response, job.prompt
        if not r.return_prompt_logprobs and not self.faults.prompt_output_always:
            return
        po = oe.PromptOutput()
        asked = r.HasField("prompt_candidates") and not self.faults.prompt_candidates_ignored
        spec = r.prompt_candidates if asked else None
        for i in range(r.prompt_logprob_start, len(prompt)):
            bare = i == 0 and not self.faults.first_prompt_logprob
            at = max(1, i - 1) if self.faults.prompt_logprobs_shifted else i
            lp = distribution(prompt[:at], prompt, 1.0, set()) if r.return_prompt_logprobs and not bare else None
            po.tokens.append(token_info(prompt[i], lp, spec, self.faults))
            if self.faults.prompt_info_without_text:
                po.tokens[-1].token = ""
        job.events.put(self.event(job, prompt=po))
