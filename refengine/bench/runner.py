"""Sending the workload: each request at its arrival time, at most ``max_concurrency`` in
flight, and a :class:`RequestRecord` of what each one saw.

A request's clock starts when it is sent, not when it arrives: one that waits for a free
slot under ``--max-concurrency`` does not count the wait in its TTFT (vllm's semantics).
The send itself is a :data:`Sender`, so the same scheduling and recording measure any
path that streams tokens (``benchmarks/serving.py`` also drives an in-process engine).

An interrupted run (Ctrl-C) neither waits for its streams nor sends what is still queued:
it cancels every call in flight, so that each server aborts its requests, and re-raises.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from refengine.bench.progress import Progress
from refengine.bench.workload import BenchRequest, RequestOptions, to_message
from refengine.client import OpenEngineClient
from refengine.protocol import oe

__all__ = ["GrpcSender", "RequestRecord", "RunResult", "Sender", "record_stream", "run"]

clock = time.perf_counter


@dataclass
class RequestRecord:
    """One request as the client saw it (times in seconds of ``clock``)."""

    index: int
    sent: float = 0.0
    ended: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    counted_tokens: int = 0  # tokens of the TokenOutput deltas
    prompt_tokens: int | None = None  # from the last Usage seen
    sent_prompt_tokens: int | None = None  # the token ids sent (None for a text prompt): input where Usage is missing
    completion_tokens: int | None = None
    finished: bool = False
    error: str | None = None  # the failure kind; None = completed
    notes: list[str] = field(default_factory=list)  # kinds noted on a completed request
    last_token: float | None = None  # when the last token-bearing event arrived

    def tokens(self, count: int, at: float) -> None:
        """``count`` tokens arrived in one event at ``at``. Each event after the first adds
        one ITL sample, the gap since the previous one, however many tokens it holds
        (vllm's ITL: one gap per chunk received)."""
        if self.last_token is None:
            self.ttft = at - self.sent
        else:
            self.itl.append(at - self.last_token)
        self.last_token = at
        self.counted_tokens += count

    def usage(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.prompt_tokens, self.completion_tokens = prompt_tokens, completion_tokens

    def fail(self, kind: str) -> None:
        if self.error is None:  # the first failure is the cause; later ones are consequences
            self.error = kind

    def close(self, at: float) -> None:
        """The stream is over: a success must have finished, and its Usage is checked
        against the tokens counted."""
        self.ended = at
        if self.error is None and not self.finished:
            self.error = "no_finish"
        if self.error is not None:
            return
        if self.completion_tokens is None:
            self.notes.append("usage_missing")
        elif self.completion_tokens != self.counted_tokens:
            self.notes.append("usage_mismatch")

    @property
    def output_tokens(self) -> int:
        """The reported count (Usage), else the counted one."""
        return self.counted_tokens if self.completion_tokens is None else self.completion_tokens

    @property
    def e2el(self) -> float:
        """Send to the stream's end, vllm's E2EL (end-to-end latency)."""
        return self.ended - self.sent

    @property
    def tpot(self) -> float | None:
        """(last token-bearing event - first token) / (output tokens - 1), vllm's TPOT; None
        under two tokens. It ends at the last token, not at the stream's end: the terminal
        event may come a step later with no token (an EOS stop), and is no token's time."""
        if self.ttft is None or self.last_token is None or self.output_tokens < 2:
            return None
        return (self.last_token - self.sent - self.ttft) / (self.output_tokens - 1)


#: Streams one request into its record (tokens, usage, finish or failure); may raise.
Sender = Callable[[BenchRequest, RequestRecord], None]


def _error_kind(error: oe.EngineError) -> str:
    try:
        return oe.ErrorCode.Name(error.code)
    except ValueError:  # a code appended after this release (X4)
        return f"ERROR_CODE_{error.code}"


def record_stream(events: Iterable[oe.GenerateResponse], record: RequestRecord) -> None:
    """Fold a Generate stream into ``record``."""
    for event in events:
        now = clock()
        if event.HasField("usage"):
            record.usage(event.usage.prompt_tokens, event.usage.completion_tokens)
        kind = event.WhichOneof("event")
        if kind == "token" and event.token.tokens:
            record.tokens(len(event.token.tokens), now)
        elif kind == "finished":
            record.finished = True
        elif kind == "error":
            record.fail(_error_kind(event.error))


class GrpcSender:
    """The :data:`Sender` of streaming Generate calls on ``client``: a refused call or a
    broken stream fails the record with the gRPC status code's name. :meth:`cancel` ends
    the run's calls: those in flight, and any started after it."""

    def __init__(self, client: OpenEngineClient, options: RequestOptions, timeout: float | None = None) -> None:
        self.client, self.options, self.timeout = client, options, timeout
        self.lock = threading.Lock()
        self.calls: set[grpc.Call] = set()  # the calls in flight
        self.cancelled = False

    def __call__(self, request: BenchRequest, record: RequestRecord) -> None:
        # the stub's call, not ``client.generate``: only the call object can be cancelled from another thread
        call = self.client.inference.Generate(to_message(request, self.options), metadata=self.client.metadata,
                                              timeout=self.timeout)
        with self.lock:
            self.calls.add(call)
            if self.cancelled:
                call.cancel()
        try:
            record_stream(call, record)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
            record.fail(code.name)
        finally:
            call.cancel()  # a no-op once the stream ended; ends it if recording broke off
            with self.lock:
                self.calls.discard(call)

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
            for call in self.calls:
                call.cancel()


@dataclass(frozen=True)
class RunResult:
    records: list[RequestRecord]
    duration: float  # s, from the first arrival to the end of the last stream


def _send_one(send: Sender, request: BenchRequest, record: RequestRecord, progress: Progress | None) -> None:
    record.sent = clock()
    try:
        send(request, record)
    except Exception as exc:  # noqa: BLE001 - one broken request is a failure to report, not the end of the run
        record.fail(type(exc).__name__)
    record.close(clock())
    if progress is not None:
        progress.advance()


def run(requests: Sequence[BenchRequest], arrivals: Sequence[float], send: Sender,
        max_concurrency: int | None = None, progress: Progress | None = None,
        cancel: Callable[[], None] | None = None) -> RunResult:
    """Send every request at ``arrivals[i]`` s after the start (or as soon as one of the
    ``max_concurrency`` workers is free; None = one worker per request), wait for all.
    On KeyboardInterrupt the queued requests are dropped, ``cancel`` ends the streams in
    flight (``GrpcSender.cancel``) and the interrupt propagates."""
    records = [RequestRecord(r.index, sent_prompt_tokens=len(r.token_ids) if r.token_ids is not None else None)
               for r in requests]
    workers = max(1, min(max_concurrency or len(requests), len(requests)))
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bench")
    start = clock()
    try:
        for request, record, at in zip(requests, records, arrivals, strict=True):
            delay = start + at - clock()
            if delay > 0:
                time.sleep(delay)
            pool.submit(_send_one, send, request, record, progress)
        pool.shutdown(wait=True)
    except KeyboardInterrupt:
        pool.shutdown(wait=False, cancel_futures=True)  # waiting would last as long as the streams
        if cancel is not None:
            cancel()
        raise
    finally:
        if progress is not None:
            progress.close()
    return RunResult(records, max((r.ended for r in records), default=start) - start)
