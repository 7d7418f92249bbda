"""What a check holds of the calls it makes: one Generate stream's events and final status
(:class:`StreamResult`, built by :meth:`Target.generate`), and a call left running on a thread
while the check does something else (:class:`Background`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from refengine.conformance.registry import CheckFailed

if TYPE_CHECKING:  # pragma: no cover
    from refengine.conformance.stream_ledger import StreamLedger


@dataclass
class StreamResult:
    """Everything one Generate call produced: the events in order and the final status."""

    request_id: str
    rule: str = ""  # the rule of the check that sent it: the structural rule it is judged by
    events: list[Any] = field(default_factory=list)  # oe.GenerateResponse
    times: list[float] = field(default_factory=list)  # perf_counter() of each event
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    started: float = 0.0
    check: str = ""  # the name of that check (a finding of the run-wide checks names it)
    ledger: StreamLedger | None = field(default=None, repr=False)  # where its structure is recorded
    recorded: bool = field(default=False, repr=False)  # by the ledger, once

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK

    def kinds(self) -> list[str]:
        return [e.WhichOneof("event") or "<none>" for e in self.events]

    def of(self, kind: str) -> list[Any]:
        return [getattr(e, kind) for e in self.events if e.WhichOneof("event") == kind]

    def token_events(self, index: int = 0) -> list[Any]:
        return [t for t in self.of("token") if t.output_index == index]

    def tokens(self, index: int = 0) -> list[int]:
        return [ti.token_id for t in self.token_events(index) for ti in t.tokens]

    def token_infos(self, index: int = 0) -> list[Any]:
        return [ti for t in self.token_events(index) for ti in t.tokens]

    def text(self, index: int = 0) -> str:
        return "".join(t.text for t in self.token_events(index))

    def finished(self, index: int = 0) -> Any | None:
        found = [f for f in self.of("finished") if f.output_index == index]
        return found[-1] if found else None

    def usage(self) -> Any | None:
        with_usage = [e.usage for e in self.events if e.HasField("usage")]
        return with_usage[-1] if with_usage else None

    def describe(self) -> str:
        return f"status {self.code.name} ({self.details!r}), events {self.kinds()}"



class Background:
    """A function running on a daemon thread; ``join`` re-raises its exception, and fails the
    check when the function has not ended within ``join_timeout`` seconds."""

    def __init__(self, fn: Callable[[], Any], join_timeout: float = 120.0) -> None:
        self.join_timeout = join_timeout
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._result = fn()
        except BaseException as err:  # noqa: BLE001 - handed to join()
            self._error = err

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> Any:
        self._thread.join(self.join_timeout)
        if self._thread.is_alive():
            raise CheckFailed(f"a background call did not end within {self.join_timeout:.0f} s")
        if self._error is not None:
            raise self._error
        return self._result
