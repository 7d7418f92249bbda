"""Per-request output streams: a thread-safe sink that also assembles the final result."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from refengine.types import EngineFault, FinishInfo, KvSessionSpec, RequestOutput, TokenInfo, Usage


@dataclass
class CompletedOutput:
    index: int
    tokens: list[TokenInfo] = field(default_factory=list)
    text: str = ""
    finish: FinishInfo | None = None

    @property
    def token_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]


@dataclass
class Completion:
    """A whole request's result, assembled from its deltas."""

    request_id: str
    outputs: list[CompletedOutput]
    prompt_tokens: list[TokenInfo] | None = None
    usage: Usage | None = None
    error_message: str | None = None
    error: EngineFault | None = None
    prefill: KvSessionSpec | None = None  # a prefill engine's handoff (K4)


class RequestStream:
    """The default output sink: queues every ``RequestOutput`` for a reader and
    folds it into a ``Completion``. Safe to feed from the engine thread while
    another thread reads."""

    def __init__(self, request_id: str, num_sequences: int) -> None:
        self.completion = Completion(request_id, [CompletedOutput(i) for i in range(num_sequences)])
        self._queue: queue.Queue[RequestOutput] = queue.Queue()
        self._done = threading.Event()

    def __call__(self, out: RequestOutput) -> None:
        c = self.completion
        if out.prompt_tokens is not None:
            c.prompt_tokens = list(out.prompt_tokens)
        for delta in out.deltas:
            target = c.outputs[delta.index]
            target.tokens.extend(delta.tokens)
            target.text += delta.text
            if delta.finish is not None:
                target.finish = delta.finish
        if out.error is not None:
            c.error_message = out.error.message
            c.error = out.error
        if out.prefill is not None:
            c.prefill = out.prefill
        if out.finished:
            c.usage = out.usage
            self._done.set()
        self._queue.put(out)

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            out = self._queue.get()
            yield out
            if out.finished:
                return

    def drain(self) -> list[RequestOutput]:
        """Outputs queued so far, without waiting (for callers that step the engine)."""
        drained = []
        while True:
            try:
                drained.append(self._queue.get_nowait())
            except queue.Empty:
                return drained

    def result(self, timeout: float | None = None) -> Completion:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.completion.request_id} did not finish in {timeout} s")
        return self.completion
