"""Engine outputs → ``GenerateResponse`` events, with the stream invariants enforced here.

For one request, :class:`ResponseBuilder` turns each ``RequestOutput`` into events:

- ``PromptOutput`` (L1) first, at most once: the engine emits prompt tokens before any
  output token;
- per delta: a ``TokenOutput`` (G10, G11: ``output_index`` always set, tokens and text are
  new only) when it has tokens or text, then ``GenerationFinished`` (G12, G13) when it ends;
- the final output: ``Usage`` (G16) on its last event, which is the last
  ``GenerationFinished`` or the terminal ``EngineError`` (X1: nothing after it).

Every event carries the request id (G9). A ``TokenOutput`` too large for one gRPC message
(e.g. ``all`` candidates over several held-back tokens) is split by tokens; the text rides
on the last piece, so concatenation is unchanged (G11). An event that still cannot fit (one
token's or the prompt's candidates, which validation estimates before acceptance but cannot
size exactly: a token's text may be 80 bytes) is never written, since gRPC would end the
stream with a bare RESOURCE_EXHAUSTED (X1, found by review): the stream ends with
``EngineError(INVALID_ARGUMENT)`` instead, with the usage of the engine's final output, and
``oversized`` tells the caller to abort the request.
"""

from __future__ import annotations

from collections.abc import Callable

from refengine.protocol import oe
from refengine.server.errors import engine_error
from refengine.types import FinishInfo, FinishReason, KvSessionSpec, RequestOutput, TokenInfo, Usage

FINISH_REASONS = {
    FinishReason.STOP: oe.FINISH_REASON_STOP,
    FinishReason.LENGTH: oe.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: oe.FINISH_REASON_CANCELLED,
}


def token_info(t: TokenInfo) -> oe.TokenInfo:
    """L3: id, text, logprob, rank and candidates travel together in one ``TokenInfo``."""
    msg = oe.TokenInfo(token_id=t.token_id, token=t.text)
    if t.logprob is not None:
        msg.logprob = t.logprob
    if t.rank is not None:
        msg.rank = t.rank
    add = msg.candidates.add  # in place: a third faster than building each LogProb, then copying it
    for c in t.candidates:
        add(token_id=c.token_id, logprob=c.logprob, token=c.text, rank=c.rank)
    return msg


def finished_event(index: int, finish: FinishInfo) -> oe.GenerationFinished:
    """G13: STOP names what matched; LENGTH / CANCELLED carry a message only."""
    msg = oe.GenerationFinished(output_index=index, reason=FINISH_REASONS[finish.reason],
                                message=finish.message)
    if finish.reason is FinishReason.STOP:
        if finish.stop_text is not None:
            msg.stop_match.stop_text = finish.stop_text
        elif finish.stop_token_id is not None:
            msg.stop_match.stop_token_id = finish.stop_token_id
        elif finish.eos_token_id is not None:
            msg.stop_match.eos_token_id = finish.eos_token_id
    return msg


def usage_message(usage: Usage) -> oe.Usage:
    """G16: total = prompt + completion; cached ≤ prompt; no reasoning parser, so no reasoning count."""
    return oe.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        cached_prompt_tokens=min(usage.cached_prompt_tokens, usage.prompt_tokens),
    )


class ResponseBuilder:
    """Builds one stream's events and remembers what was sent, so a broken engine
    invariant becomes a terminal ``EngineError`` rather than a malformed stream."""

    def __init__(self, request_id: str, num_sequences: int, max_message_bytes: int,
                 session_ref: Callable[[KvSessionSpec], oe.KvSessionRef] | None = None) -> None:
        self.session_ref = session_ref  # a prefill server's session handle, with its endpoints
        self.request_id = request_id
        self.num_sequences = num_sequences
        self.max_message_bytes = max_message_bytes
        self.finished_indexes: set[int] = set()
        self.prompt_sent = False
        self.terminal_sent = False
        self.oversized: oe.EngineError | None = None  # set: an event could not fit; the next final output ends it

    def _event(self, **event) -> oe.GenerateResponse:  # noqa: ANN003 - one oneof field
        return oe.GenerateResponse(request_id=self.request_id, **event)

    def _token_outputs(self, index: int, tokens: list[oe.TokenInfo], text: str) -> list[oe.GenerateResponse]:
        whole = self._event(token=oe.TokenOutput(output_index=index, tokens=tokens, text=text))
        if len(tokens) <= 1 or whole.ByteSize() <= self.max_message_bytes // 2:
            return [whole]
        pieces = [self._event(token=oe.TokenOutput(output_index=index, tokens=[t])) for t in tokens]
        pieces[-1].token.text = text
        return pieces

    def events(self, out: RequestOutput) -> list[oe.GenerateResponse]:
        """Events for one engine output. Empty list = nothing to send."""
        if self.terminal_sent:
            raise RuntimeError(f"request {self.request_id}: output after the terminal event")
        if self.oversized is not None:  # the request is being aborted: only its end is sent
            return self._terminal_error([], out, self.oversized) if out.finished else []
        return self._fitting(self._events(out), out)

    def _fitting(self, events: list[oe.GenerateResponse], out: RequestOutput) -> list[oe.GenerateResponse]:
        """``events`` up to the first that cannot fit one message; from there the stream's
        end: at once when ``out`` was final, else after the abort (``oversized``)."""
        sizes = [event.ByteSize() for event in events]
        first = next((i for i, size in enumerate(sizes) if size > self.max_message_bytes), None)
        if first is None:
            return events
        error = oe.EngineError(code=oe.ERROR_CODE_INVALID_ARGUMENT, retryable=False, message=(
            f"an event of this stream needs {sizes[first]} bytes, more than the {self.max_message_bytes >> 20} MiB "
            "message limit (--max-send-message-mib): ask for fewer candidates or logprob positions"))
        if self.terminal_sent:  # ``out`` was the final output
            self.terminal_sent = False
            return self._terminal_error(events[:first], out, error)
        self.oversized = error
        return events[:first]

    def _events(self, out: RequestOutput) -> list[oe.GenerateResponse]:
        events: list[oe.GenerateResponse] = []
        if out.prompt_tokens is not None and not self.prompt_sent:
            prompt = oe.PromptOutput(tokens=[token_info(t) for t in out.prompt_tokens])
            events.append(self._event(prompt=prompt))
            self.prompt_sent = True
        last_finished: oe.GenerateResponse | None = None
        for delta in out.deltas:
            if delta.index in self.finished_indexes or not 0 <= delta.index < self.num_sequences:
                return self._internal(events, out, f"engine sent a delta for output {delta.index} "
                                      "after its end or out of range")
            if delta.tokens or delta.text:
                tokens = [token_info(t) for t in delta.tokens]
                events.extend(self._token_outputs(delta.index, tokens, delta.text))
            if delta.finish is not None and out.error is None:
                last_finished = self._event(finished=finished_event(delta.index, delta.finish))
                events.append(last_finished)
                self.finished_indexes.add(delta.index)
        if out.error is not None:
            return self._terminal_error(events, out, engine_error(out.error))
        if out.prefill is not None:  # K4: the terminal success of a prefill server; no tokens came
            if self.session_ref is None:
                return self._internal(events, out, "the engine made a KV session, but this edge cannot hand it out")
            ready = self._event(prefill_ready=oe.PrefillReady(kv_session=self.session_ref(out.prefill)))
            if out.usage is not None:
                ready.usage.CopyFrom(usage_message(out.usage))
            self.terminal_sent = True
            return events + [ready]
        if not out.finished:
            return events
        missing = sorted(set(range(self.num_sequences)) - self.finished_indexes)
        if missing or last_finished is None:
            return self._internal(events, out, f"engine ended the request with outputs {missing} unfinished")
        if out.usage is not None:
            last_finished.usage.CopyFrom(usage_message(out.usage))
        self.terminal_sent = True
        return events

    def _terminal_error(self, events: list[oe.GenerateResponse], out: RequestOutput,
                        error: oe.EngineError) -> list[oe.GenerateResponse]:
        final = self._event(error=error)
        if out.usage is not None:
            final.usage.CopyFrom(usage_message(out.usage))
        self.terminal_sent = True
        return events + [final]

    def _internal(self, events: list[oe.GenerateResponse], out: RequestOutput,
                  message: str) -> list[oe.GenerateResponse]:
        error = oe.EngineError(code=oe.ERROR_CODE_INTERNAL, message=message, retryable=False)
        return self._terminal_error(events, out, error)
