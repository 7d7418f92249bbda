"""Drain and cancel races of ``Inference.Generate``, each on a server of its own (RULES X3, G2).

The races are forced, not timed: an engine step made seconds long by a ~1500-token prompt (the
drain deadline falls inside it; GetLoad shows the prefill under way), or a request held inside
acceptance by a slow grammar compile on the worker thread (hundreds of optional properties, about
a second) when SIGTERM arrives or the client cancels.

X3: every stream a drain cuts off ends with exactly one ``EngineError(CANCELLED, retryable)`` naming
the drain, also one that was still being accepted; a request being accepted gets the grace period
like a running stream; the KV of cut-off requests is freed before the process exits.
G2: an id is reusable as soon as its stream ended, also when the client cancelled during acceptance.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc

from refengine.client import OpenEngineClient
from refengine.protocol import oe
from tests.integration.conftest import (
    ServerProcess,
    Stream,
    check_stream,
    collect,
    greedy_request,
    running_server,
    start_server,
    wait_idle,
)

LONG_PROMPT_TOKENS = 1500  # a prefill step of about 3 s on a CPU (well over the old 1.5 s flush)
GRAMMAR_PROPERTIES = 400  # optional properties: a compile of about a second
IN_ACCEPTANCE_SECONDS = 0.4  # the request reached the server (also under load) and is compiling its grammar
EXIT_SECONDS = 60.0  # generous: the suite runs two workers on two cores


def _long_prompt(request_id: str, max_tokens: int = 50, tokens: int = LONG_PROMPT_TOKENS) -> oe.GenerateRequest:
    ids = [(7 * k) % 4000 + 100 for k in range(tokens)]
    request = oe.GenerateRequest(request_id=request_id, token_ids=oe.TokenIds(ids=ids))
    request.stopping.max_tokens = max_tokens
    return request


def _slow_grammar(request_id: str, max_tokens: int) -> oe.GenerateRequest:
    """A guided request accepted only after a slow compile; its names are new to every cache."""
    salt = uuid.uuid4().hex[:8]
    properties = {f"p{salt}{i}": {"type": ["string", "integer", "array"], "items": {"type": "number"}}
                  for i in range(GRAMMAR_PROPERTIES)}
    request = greedy_request(request_id, "Give JSON.", max_tokens=max_tokens)
    request.guided.json_schema = json.dumps({"type": "object", "properties": properties}, separators=(",", ":"))
    return request


class _Call:
    """One Generate consumed on a thread of its own."""

    def __init__(self, client: OpenEngineClient, request: oe.GenerateRequest) -> None:
        self.request = request
        self.stream = Stream()
        self.first_event = threading.Event()
        self._thread = threading.Thread(target=self._consume, args=(client,), daemon=True)
        self._thread.start()

    def _consume(self, client: OpenEngineClient) -> None:
        try:
            for event in client.generate(self.request, timeout=120):
                self.stream.events.append(event)
                self.first_event.set()
        except grpc.RpcError as exc:
            self.stream.code, self.stream.details = exc.code(), exc.details()

    def join(self) -> Stream:
        self._thread.join(EXIT_SECONDS)
        assert not self._thread.is_alive(), f"{self.request.request_id}: the stream never ended"
        return self.stream


def _wait_for(what: str, condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + EXIT_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {EXIT_SECONDS:g} s"
        time.sleep(0.02)


def _prefilling(client: OpenEngineClient, running: int) -> bool:
    """The step under way prefills, with ``running`` requests in all (GetLoad's snapshot is taken
    once a step has chosen its batch; a count of one less is the step before, e.g. the first
    token of the decoding stream)."""
    load = client.load()
    return load.prefill_batch_size > 0 and load.running_requests == running


def _queued_or_idle(client: OpenEngineClient) -> bool:
    load = client.load()
    return load.queued_requests > 0 or load.running_requests == 0


def _assert_drained(call: _Call) -> None:
    """X3: status OK, and the stream's last and only error is the drain's retryable CANCELLED."""
    stream = call.join()
    check_stream(stream, call.request, success=False)
    errors = stream.of("error")
    assert len(errors) == 1 and stream.events[-1].WhichOneof("event") == "error", stream.events[-3:]
    assert errors[0].code == oe.ERROR_CODE_CANCELLED and errors[0].retryable, errors[0]
    assert "drain" in errors[0].message, errors[0].message


def _stopped(server: ServerProcess) -> str:
    """Wait for the exit (code 0, no traceback); returns the log."""
    code = server.proc.wait(EXIT_SECONDS)
    log = server.log_tail(50000)
    assert code == 0 and "Traceback" not in log, log[-3000:]
    return log


def _kv_used_at_exit(log: str) -> int:
    used = re.search(r"KV pool at exit: (\d+) used", log)
    assert used is not None, log[-3000:]
    return int(used.group(1))


def _start(tmp_path: Path, *args: str) -> ServerProcess:
    return start_server(tmp_path / "server.log", "--max-model-len", "2048", "--num-kv-blocks", "256", *args)


@contextmanager
def _inside_a_long_step(tmp_path: Path) -> Iterator[tuple[ServerProcess, OpenEngineClient, list[_Call]]]:
    """A server (grace 0.1 s) whose engine is inside one long step shared by a decoding stream
    and a long prefill."""
    server = _start(tmp_path, "--shutdown-grace-seconds", "0.1")
    try:
        with OpenEngineClient(server.address) as client:
            decoding = _Call(client, greedy_request("decoding", "Write a long story.", max_tokens=1500,
                                                    ignore_eos=True))
            assert decoding.first_event.wait(EXIT_SECONDS), "no first token"
            prefill = _Call(client, _long_prompt("prefill"))
            _wait_for("long prefill step", lambda: _prefilling(client, running=2))
            yield server, client, [decoding, prefill]
    finally:
        server.stop()


def test_a_drain_inside_a_long_step_ends_every_stream_with_the_drain_error(tmp_path: Path) -> None:
    """X3: the deadline falls inside the step; the cut-off streams' terminal events wait for the
    engine to confirm the aborts after it, and the drain lets them be written before the listeners
    stop (not UNAVAILABLE). A request still compiling its grammar at the deadline is cut off as
    soon as it is accepted."""
    with _inside_a_long_step(tmp_path) as (server, client, calls):
        calls.append(_Call(client, _slow_grammar("late", max_tokens=1500)))
        time.sleep(IN_ACCEPTANCE_SECONDS)
        server.signal(signal.SIGTERM)
        for call in calls:
            _assert_drained(call)
        assert _kv_used_at_exit(_stopped(server)) == 0


def test_a_second_signal_inside_a_long_step_still_frees_the_kv(tmp_path: Path) -> None:
    """Stopping at once (no flush), the engine loop still applies the aborts of the cut-off
    requests after its last step. The streams may end without their EngineError then."""
    with _inside_a_long_step(tmp_path) as (server, client, calls):
        server.signal(signal.SIGTERM)
        _wait_for("drain", lambda: client.health().state != oe.HEALTH_STATE_READY)
        server.signal(signal.SIGTERM)  # once the first was handled: signals do not queue
        for call in calls:
            call.join()
        assert _kv_used_at_exit(_stopped(server)) == 0


def test_a_request_in_acceptance_gets_the_grace_period(tmp_path: Path) -> None:
    """X3: SIGTERM while the only request compiles its grammar: the drain waits for it as for a
    running stream, and it runs to its end within the grace period."""
    server = _start(tmp_path, "--shutdown-grace-seconds", "60")
    try:
        with OpenEngineClient(server.address) as client:
            call = _Call(client, _slow_grammar("accepting", max_tokens=4))
            time.sleep(IN_ACCEPTANCE_SECONDS)
            server.signal(signal.SIGTERM)
            check_stream(call.join(), call.request)
            assert _kv_used_at_exit(_stopped(server)) == 0
    finally:
        server.stop()


def test_an_id_cancelled_during_acceptance_is_reusable_at_once(tmp_path: Path) -> None:
    """G2: the client cancels while its request compiles; the compile ends during a long step, so
    the engine holds the id (aborted, not yet retired) when a new request reuses it: that one waits
    for the retirement, as after any other cancel, instead of getting ALREADY_EXISTS."""
    with running_server(tmp_path / "server.log", "--max-model-len", "2048", "--num-kv-blocks", "256") as server, \
            OpenEngineClient(server.address) as client:
        # A shorter step (about 2 s): the reuse waits for the rest of it, within its deadline.
        busy = _Call(client, _long_prompt("busy", max_tokens=1, tokens=1200))
        _wait_for("long prefill step", lambda: _prefilling(client, running=1))
        cancelled = client.inference.Generate(_slow_grammar("reused", max_tokens=20), timeout=60)
        time.sleep(IN_ACCEPTANCE_SECONDS)
        cancelled.cancel()
        # Accepted: queued in the engine's inbox behind the long step, aborted, not yet retired.
        # (Should the step end first, the race is missed and the reuse is trivially fine.)
        _wait_for("accepted request", lambda: _queued_or_idle(client))
        reuse = greedy_request("reused", "Hi", max_tokens=2)
        check_stream(collect(client, reuse), reuse)
        check_stream(busy.join(), busy.request)
        wait_idle(client)
